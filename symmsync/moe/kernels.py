"""The dispatcher's kernels: two launches per step (:mod:`.protocol` says why and in what order),
each bound once (:mod:`symmsync.core.launch`).

Placement, computed by the sender with prefix counts (no atomic decides a row's place): token
``t`` of member ``s`` routed to expert ``e`` (owned by member ``e // EL`` as its local expert
``e % EL``) lands in row ``offsets[e][s] + p`` of that expert's packed rows in the receiver's
buffer, ``p`` the number of tokens ``t' < t`` of ``s`` routed to ``e`` and ``offsets[e][s]`` the
rows every member before ``s`` sends ``e`` (from the counts every member sent first). So local
expert ``e``'s received rows are ``recv[e][:counts[e]]``, in (source member, token index) order,
stored once, where the receiver's dispatch returns them. An entry ``topk_idx[t, k]`` is skipped
when it is -1, or when an earlier entry of the same token names the same expert (a (token,
expert) pair is sent once); one below -1 or not below the number of experts refuses the step on
every member.

Programs: every launch but a dispatch's receive (one program) is sized by the device, not by
``max_tokens`` (``programs``: two a multiprocessor for a dispatch, four for a combine), so that
few programs wait or find nothing to do: a dispatch's send's and a combine's reduce's loop over (token, chunk of ``HB``
channels) items, loading (and quantizing) a chunk once and storing it for each of the token's
experts; a combine's send's, a few per (local expert and source), loop over blocks of ``RB``
rows as far as that source's count. Each moves whole chunks of a row with one masked access per
chunk. Every program of a dispatch's send reads the call's ids once (``BT`` tokens, the
dispatcher's ``max_tokens`` rounded up to a power of 2, masked past the call's) and finds the
earliest id out of range; the program with the launch's first ticket counts them with one atomic
add per entry that sends a row into the dispatcher's ``tally`` (:func:`_counts`: integer sums, the same every run).

Where the time goes (a dispatch): the send's phase A (the first ticket's program: the counts, O(tokens x top_k)
adds and one exchange per expert, the header, one release per member), its wait for every other
member's phase A (the step's one synchronization before the rows move), phase B (the rows, once,
at the wire's rate), the last program's release, the receive's wait for every member's last
release and its few stores. ``benchmarks/moe.py`` times the launches, ``benchmarks/moe_phases.py``
the phases (:func:`_stamp`); Nsight Compute's source view of ``dispatch_send`` splits phase B's
stores from the waits (``wait_signal``'s poll loop).

Element types under Triton's interpreter: numpy has no bfloat16, so bfloat16 tensors
travel as their int16 bits (``BITS``) and are widened and rounded by integer arithmetic
(:mod:`symmsync.language.bf16`); fp8 codes are :mod:`symmsync.language.e4m3`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

import symmsync.language as ssl

from ..language.bf16 import from_f32, to_f32
from ..language.e4m3 import AMAX_FLOOR, E4M3_MAX, to_e4m3
from . import protocol
from .layout import FP8_GROUP

_GROUP = tl.constexpr(FP8_GROUP)
_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(E4M3_MAX)
_DISPATCH = tl.constexpr(protocol.DISPATCH)
_COMBINE = tl.constexpr(protocol.COMBINE)
_COUNTS = tl.constexpr(protocol.COUNTS)
_END = tl.constexpr(protocol.END)
_SENT = tl.constexpr(protocol.SENT)
_PER_STEP = tl.constexpr(protocol.PER_STEP)
_REFUSED_EXPERT_ID = tl.constexpr(protocol.REFUSED_EXPERT_ID)
_FAR = tl.constexpr(1 << 30)  # past any entry's index (int32): the earliest bad entry's minimum


@triton.jit
def _stamp(times, WORD: tl.constexpr, mine, TIMES: tl.constexpr):
    """With ``TIMES`` (a dispatcher made under ``SYMMSYNC_MOE_PHASE_TIMES=1``), ``times[WORD]`` = the
    clock (ns, ``ssl.clock_ns``) where ``mine``: a dispatch's send starts (0), its first ticket's program posted
    its counts (1) and passed its counts wait (2), program 0's rows are stored (3), the last program
    signalled (4); its receive passed its wait (5). Without ``TIMES`` nothing is compiled in."""
    if TIMES:
        if mine:
            tl.store(times + WORD, ssl.clock_ns())


@triton.jit
def _entries(topk, T, t0, E: tl.constexpr, TOPK: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr):
    """This member's routing of tokens ``t0 .. t0 + BT - 1``: ``(tt, kk, ids, sent, bad)``, ``ids``
    ``[BT, KP]`` (-1 past the tokens and entries), ``sent`` the entries that send a row (an expert id
    that no earlier entry of the token named), ``bad`` the entries out of range (below -1, or not
    below ``E``)."""
    tt = t0 + tl.arange(0, BT)[:, None]
    kk = tl.arange(0, KP)[None, :]
    live = (tt < T) & (kk < TOPK)
    ids = tl.load(topk + tt * TOPK + kk, mask=live, other=-1)
    again = tl.zeros([BT, KP], dtype=tl.int32)
    for j in tl.static_range(TOPK):  # an earlier entry of the token named the same expert
        col = tl.load(topk + tt * TOPK + j, mask=tt < T, other=-1)
        again += ((ids == col) & (kk > j)).to(tl.int32)
    sent = live & (ids >= 0) & (ids < E) & (again == 0)
    bad = live & ((ids < -1) | (ids >= E))
    return tt, kk, ids, sent, bad


@triton.jit
def _counts(
    topk, calls, sig, me, n, tally, named, tt, kk, bad, code, counts_off, rows_off,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, EP: tl.constexpr,
):  # fmt: skip
    """Phase A of a dispatch (the program of its send that took the first ticket): this member's count of rows for
    every expert (0 for all when it refuses the step), into every member's counts ``[me]``, then its header, then
    its first signal (:func:`.protocol.post`); the header's size word is ``rows_off``, the step's rows buffer.
    ``named`` is :func:`_entries`'s ids where they send a row, -1 elsewhere (int32): one relaxed GPU-scope add per
    sent entry into ``tally`` (the dispatcher's ``E`` words, zero between dispatches), a block barrier, then one
    exchange per expert reads each count and leaves 0 (what the next step, or a graph's replay, starts from).
    O(tokens x top_k) adds, not a compare per (token, entry, expert); the sums do not depend on the adds' order: the
    same counts every run."""
    ex = tl.arange(0, EP)
    named = tl.where(code == 0, named, -1)  # a refused step counts nothing: it sends 0 counts
    tl.atomic_add(tally + named, 1, mask=named >= 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # every thread's adds before any thread's exchange
    cnt = tl.atomic_xchg(tally + ex, 0, mask=ex < E, sem="relaxed", scope="gpu").to(tl.int64)
    for m in tl.static_range(SIZE):
        tl.store(ssl.data_ptr(sig, m, counts_off + me * E * 8, tl.int64) + ex, cnt, mask=ex < E)
    first = tl.min(tl.min(tl.where(bad, tt * TOPK + kk, _FAR), axis=1), axis=0)  # the earliest bad entry
    where = tl.where(code == _REFUSED_EXPERT_ID, first, 0)
    value = tl.load(topk + where, mask=code == _REFUSED_EXPERT_ID, other=0)
    protocol.post(calls, sig, me, n, code, where, value, rows_off, _DISPATCH, SIZE, NSLOTS, 1)


@triton.jit
def _rows_nan(sig, me, rows_off, scales_off, pid, programs, DT: tl.constexpr, ROWS: tl.constexpr, H: tl.constexpr,
              HB: tl.constexpr, C: tl.constexpr, FP8: tl.constexpr, GB: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """NaN in every one of this member's ``ROWS`` received rows (with ``FP8``: the e4m3 NaN code, and
    NaN scales), the (row, chunk) items ``pid, pid + programs, ..``."""
    i = pid
    while i < ROWS * C:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        row = (i // C).to(tl.int64)
        c = i % C
        col = c * HB + tl.arange(0, HB)
        if FP8:
            tl.store(ssl.data_ptr(sig, me, rows_off + row * H, tl.uint8) + col, tl.full([HB], 0x7F, tl.uint8),
                     mask=col < H)  # fmt: skip
            g = tl.arange(0, GB)
            sdst = ssl.data_ptr(sig, me, scales_off + row * (H // _GROUP) * 4, tl.float32)
            tl.store(
                sdst + c * (HB // _GROUP) + g, tl.full([GB], float("nan"), tl.float32), mask=c * HB + g * _GROUP < H
            )
        else:
            ELEM: tl.constexpr = DT.primitive_bitwidth // 8
            dst = ssl.data_ptr(sig, me, rows_off + row * H * ELEM, DT)
            tl.store(dst + col, from_f32(tl.full([HB], float("nan"), tl.float32), DT, BITS), mask=col < H)
        i += programs


@triton.jit
def dispatch_send(
    x, topk, T, refused, calls, state, sig, me, timeout_ns, record, times, tally,
    rows_off, scales_off, src_off, counts_off, counts_stride,
    TIMES: tl.constexpr, SIZE: tl.constexpr, SP: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
    E: tl.constexpr, EL: tl.constexpr, M: tl.constexpr, H: tl.constexpr, HB: tl.constexpr, C: tl.constexpr,
    TOPK: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, FP8: tl.constexpr,
    GB: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """A dispatch's one send launch (:mod:`.protocol`, phases A and B): the first ticket's program stores this
    member's counts, header and first signal (:func:`_counts`); every program waits for every other
    member's counts and header and checks the step (:func:`.protocol.check`), then, when the step
    may go on, takes the (token ``t``, chunk ``c``) items ``i = t * C + c`` it is given (``p, p + P,
    ..``, ``P`` the grid, sized by the device): loads (with ``FP8``, quantizes) the chunk once and
    stores it, and from chunk 0 the source index, straight into its packed place in the receiver's
    buffer (``rows_off``, ``scales_off``, ``src_off``) for each entry of the token that no earlier
    entry named (its place: the sent entries of earlier tokens naming its expert, counted in
    ``named``, plus every earlier member's count). The last program to arrive signals every member
    again (:func:`.protocol.sent`). When the step failed, it stores NaN in this member's received rows
    instead (:func:`_rows_nan`: no member sends a row). ``tally``: the counts' ``E`` int32 words (:func:`_counts`). With
    ``TIMES``, clock stamps into ``times`` (:func:`_stamp`)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    _stamp(times, 0, pid == 0, TIMES)
    n = ssl.call_number(calls)
    counts_off += protocol.parity(calls) * counts_stride
    tt, kk, ids, sent, bad = _entries(topk, T, 0, E, TOPK, BT, KP)
    named = tl.where(sent, ids, -1).to(tl.int32)  # the expert of each entry that sends a row (ids < E: exact)
    code = protocol.refusal(refused, tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0) > 0)
    first = protocol.first_in(state)  # a program that runs posts the counts, not necessarily program 0
    if first:
        _counts(topk, calls, sig, me, n, tally, named, tt, kk, bad, code, counts_off, rows_off, SIZE, NSLOTS, E, TOPK,
                EP)  # fmt: skip
    _stamp(times, 1, first, TIMES)
    n, status, who = protocol.check(
        calls, sig, me, timeout_ns, record, state, rows_off, code, _DISPATCH, _COUNTS, SIZE, NSLOTS, TRAP
    )
    _stamp(times, 2, pid == 0, TIMES)
    if status == ssl.CALL_OK:
        own = ssl.data_ptr(sig, me, counts_off, tl.int64)  # every member's counts, as they sent them
        s = tl.arange(0, SP)
        ks = tl.arange(0, KP)
        i = pid
        while i < T * C:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
            t = (i // C).to(tl.int64)  # int64: t * H may pass 2^31 elements
            c = i % C
            mine = tl.load(topk + t * TOPK + ks, mask=ks < TOPK, other=-1)  # this token's entries
            if FP8:
                g = tl.arange(0, GB)[:, None]
                ch = tl.arange(0, _GROUP)[None, :]
                col = c * HB + g * _GROUP + ch
                live = col < H
                v = to_f32(tl.load(x + t * H + col, mask=live, other=0), BITS)
                amax = tl.max(tl.abs(v), axis=1)
                sc = tl.math.div_rn(tl.maximum(amax, _FLOOR), _FP8_MAX)
                vals = to_e4m3(tl.math.div_rn(v, sc[:, None]))
                gs = tl.arange(0, GB)
            else:
                col = c * HB + tl.arange(0, HB)
                live = col < H
                vals = tl.load(x + t * H + col, mask=live)
            for k in tl.static_range(TOPK):
                e = tl.load(topk + t * TOPK + k)
                again = tl.sum(((ks < k) & (mine == e)).to(tl.int32), axis=0)  # an earlier entry named it
                if (e >= 0) & (e < E) & (again == 0):
                    pos = tl.sum(tl.sum(((named == e.to(tl.int32)) & (tt < t)).to(tl.int32), axis=1), axis=0)
                    before = tl.sum(tl.load(own + s * E + e, mask=s < me, other=0), axis=0)  # earlier members'
                    m = e // EL
                    row = (e % EL).to(tl.int64) * (SIZE * M) + before + pos  # int64: a region may pass 2 GiB
                    if FP8:
                        dst = ssl.data_ptr(sig, m, rows_off + row * H, tl.uint8)
                        tl.store(dst + col, vals, mask=live)
                        sdst = ssl.data_ptr(sig, m, scales_off + row * (H // _GROUP) * 4, tl.float32)
                        tl.store(sdst + c * (HB // _GROUP) + gs, sc, mask=c * HB + gs * _GROUP < H)
                    else:
                        ELEM: tl.constexpr = x.dtype.element_ty.primitive_bitwidth // 8
                        dst = ssl.data_ptr(sig, m, rows_off + row * H * ELEM, x.dtype.element_ty)
                        tl.store(dst + col, vals, mask=live)
                    if c == 0:
                        tl.store(ssl.data_ptr(sig, m, src_off + row * 8, tl.int64), t * TOPK + k)
            i += programs
    else:  # a failed step sends no row: this member's rows read NaN, never an earlier dispatch's
        _rows_nan(sig, me, rows_off, scales_off, pid, programs, x.dtype.element_ty, EL * SIZE * M, H, HB, C, FP8,
                  GB, BITS)  # fmt: skip
    _stamp(times, 3, pid == 0, TIMES)
    if protocol.sent_last(state, programs):
        protocol.sent(sig, me, state, SIZE, NSLOTS)
        _stamp(times, 4, True, TIMES)


@triton.jit
def dispatch_recv(
    counts_out, per_source, offsets, calls, state, sig, me, timeout_ns, record, times, rows_off, counts_off,
    counts_stride, TIMES: tl.constexpr, SIZE: tl.constexpr, SP: tl.constexpr, NSLOTS: tl.constexpr,
    TRAP: tl.constexpr, E: tl.constexpr, EL: tl.constexpr, ELP: tl.constexpr,
):  # fmt: skip
    """A dispatch's receive (one program): waits for every member's rows and checks the step
    (:func:`.protocol.check`), then stores the counts of this member's experts, per source and in
    all, and the offsets, from the counts every member sent it (when the step failed:
    ``per_source`` -1, the counts and offsets 0: no rows, and its combine knows). It copies no row:
    the senders stored them in their packed places. It counts the step."""
    refused = ssl.posted_refusal(calls)
    counts_off += protocol.parity(calls) * counts_stride  # read before the step is counted
    step, status, who = protocol.check(
        calls, sig, me, timeout_ns, record, state, rows_off, refused, _DISPATCH, _END, SIZE, NSLOTS, TRAP
    )
    _stamp(times, 5, True, TIMES)
    ok = status == ssl.CALL_OK
    own = ssl.data_ptr(sig, me, counts_off, tl.int64)
    s = tl.arange(0, SP)[:, None]
    el = tl.arange(0, ELP)[None, :]
    live = (s < SIZE) & (el < EL)
    cnt = tl.load(own + s * E + me * EL + el, mask=live, other=0)
    cnt = tl.where(ok, cnt, 0)
    tl.store(per_source + el * SIZE + s, tl.where(ok, cnt, -1), mask=live)
    tl.store(offsets + el * SIZE + s, tl.cumsum(cnt, axis=0) - cnt, mask=live)
    e1 = tl.arange(0, ELP)
    tl.store(counts_out + e1, tl.sum(cnt, axis=0), mask=e1 < EL)
    protocol.finish(calls, me, step, state, status, who, _DISPATCH, SIZE)


@triton.jit
def combine_send(
    out, per_source, offsets, src, refused, calls, state, sig, me, comb_off, stride,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, M: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
    RB: tl.constexpr,
):  # fmt: skip
    """Step 1 of a combine: program ``(e * SIZE + s, b)`` stores the expert's outputs for the blocks
    ``b, b + B, ..`` (``B`` the grid's second axis, sized by the device) of ``RB`` rows of member
    ``s``'s (packed from ``offsets[e][s]``), as far as the rows ``s`` sent, into ``s``'s combine
    region, at the row their source index names (token ``t``, entry ``k``). The last program to
    arrive posts the header and signals every member both of the step's signals
    (:func:`.protocol.post`)."""
    pid = tl.program_id(0)
    el = pid // SIZE
    s = pid % SIZE
    b = tl.program_id(1)
    n = ssl.call_number(calls)
    base = protocol.parity(calls) * stride
    count = tl.load(per_source + el * SIZE + s)
    start = tl.load(offsets + el * SIZE + s)
    cols = tl.arange(0, HP)
    dst = ssl.data_ptr(sig, s, comb_off + base, out.dtype.element_ty)  # member s's region, looked up once
    while b * RB < count:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        for i in tl.static_range(RB):
            j = b * RB + i
            if j < count:
                row = el * (SIZE * M) + start + j
                slot = tl.load(src + row)
                tl.store(dst + slot * H + cols, tl.load(out + row * H + cols, mask=cols < H), mask=cols < H)
        b += tl.num_programs(1)
    if protocol.arrive_last(state, _SENT, tl.num_programs(0) * tl.num_programs(1)):
        code = protocol.refusal(refused, refused < 0)  # no id of its own to refuse
        protocol.post(calls, sig, me, n, code, 0, 0, 0, _COMBINE, SIZE, NSLOTS, _PER_STEP)


@triton.jit
def combine_reduce(
    y, topk, weights, T, per_source, calls, state, sig, me, timeout_ns, record, comb_off, stride,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, E: tl.constexpr, H: tl.constexpr,
    HB: tl.constexpr, C: tl.constexpr, TOPK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Step 2 of a combine: each program waits and checks the step (:func:`.protocol.check`) once,
    then sums the (token ``t``, chunk ``c``) items ``i = t * C + c`` it is given (``i = p, p + P, ..``,
    ``P`` the grid, sized by the device: few programs wait) in float32, in the order
    ``k = 0 .. top_k - 1``: ``acc = acc + w[t, k] * out_k`` (``out_k`` the row its expert sent back;
    an entry naming the expert of an earlier entry reads that entry's row), then rounds once
    (NaN when the step failed, or the handle's dispatch did: its ``per_source`` holds -1, and no row
    was sent back). The last program to arrive counts the step."""
    base = protocol.parity(calls) * stride  # read before the step is counted
    step, status, who = protocol.check(
        calls, sig, me, timeout_ns, record, state, 0, ssl.posted_refusal(calls), _COMBINE, _END, SIZE, NSLOTS, TRAP
    )
    ok = (status == ssl.CALL_OK) & (tl.load(per_source) >= 0)  # and the handle's dispatch went well
    own = ssl.data_ptr(sig, me, comb_off + base, y.dtype.element_ty)
    i = tl.program_id(0)
    while i < T * C:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        t = (i // C).to(tl.int64)  # int64: (t * TOPK + k) * H may pass 2^31 elements
        cols = (i % C) * HB + tl.arange(0, HB)
        acc = tl.zeros([HB], dtype=tl.float32)
        for k in tl.static_range(TOPK):
            e = tl.load(topk + t * TOPK + k)
            valid = (e >= 0) & (e < E) & ok
            k0 = k
            for jj in tl.static_range(k):  # the earliest entry naming the same expert
                j = k - 1 - jj
                k0 = tl.where(tl.load(topk + t * TOPK + j) == e, j, k0)
            w = tl.load(weights + t * TOPK + k)
            if valid:
                v = to_f32(tl.load(own + (t * TOPK + k0) * H + cols, mask=cols < H, other=0), BITS)
                acc = acc + w * v
        acc = tl.where(ok, acc, float("nan"))  # a failed step's rows read NaN
        tl.store(y + t * H + cols, from_f32(acc, y.dtype.element_ty, BITS), mask=cols < H)
        i += tl.num_programs(0)
    protocol.finish(calls, me, step, state, status, who, _COMBINE, SIZE)
