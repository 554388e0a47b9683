"""The dispatcher's kernels: two launches per step (:mod:`.protocol` says why and in what order),
each bound once (:mod:`symmsync.core.launch`).

Placement, computed by the sender with a prefix count (no atomics): token ``t`` of member
``s`` routed to expert ``e`` (owned by member ``e // EL`` as its local expert ``e % EL``) lands
in row ``p`` of source ``s``'s block of that expert in the receiver's region, ``p`` the number
of tokens ``t' < t`` of ``s`` routed to ``e``. The receiver packs the blocks: local expert
``e``'s received rows are ``recv[e][:counts[e]]``, source ``s``'s from ``offsets[e][s]``, in
(source member, token index) order. An entry ``topk_idx[t, k]`` is skipped when it is -1, or
when an earlier entry of the same token names the same expert (a (token, expert) pair is sent
once); one below -1 or not below the number of experts refuses the step on every member
(:func:`.protocol.refuse_id`).

Programs: a dispatch's send runs one program per (token, chunk of ``HB`` channels), which
loads (and quantizes) its chunk once and stores it for each of the token's experts. The
other launches are sized by the device, not by ``max_tokens`` (about two programs a
multiprocessor), so that few programs wait or find nothing to do: a read's and a combine's
send's, a few per (local expert and source), loop over blocks of ``RB`` rows as far as that
source's count; a combine's reduce's loop over (token, chunk) pairs. Each moves whole chunks
of a row with one masked access per chunk.

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
_SENT = tl.constexpr(protocol.SENT)


@triton.jit
def _sources(counts, el, SIZE: tl.constexpr, SP: tl.constexpr):
    """Member-indexed counts of local expert ``el`` (``[SP]``, zeros past ``SIZE``) from a counts array."""
    m = tl.arange(0, SP)
    return m, tl.load(counts + el * SIZE + m, mask=m < SIZE, other=0)


@triton.jit
def dispatch_send(
    x, topk, T, refused, calls, state, sig, me, rows_off, scales_off, src_off, counts_off, stride,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, E: tl.constexpr, EL: tl.constexpr, M: tl.constexpr,
    H: tl.constexpr, HB: tl.constexpr, C: tl.constexpr, TOPK: tl.constexpr, BT: tl.constexpr,
    KP: tl.constexpr, FP8: tl.constexpr, GB: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Step 1 of a dispatch: program ``(t, c)`` loads chunk ``c`` of token ``t``'s row once (with
    ``FP8``, quantizes it once: its codes and scales), then stores it, and from chunk 0 the source
    index, into the region of the expert of each entry ``k`` of the token that no earlier entry
    named; the earliest id out of range is kept (:func:`.protocol.refuse_id`). The ``P`` programs share the
    counts: the ``p``-th (in ``(t, c)`` order) stores this member's count of experts
    ``p, p + P, ..`` into their receivers' regions, before its arrival as its rows, from the ids
    of every token loaded once. The last
    program to arrive notifies (:func:`.protocol.notify`)."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    base = protocol.parity(calls) * stride
    if t < T:
        ks = tl.arange(0, KP)
        mine = tl.load(topk + t * TOPK + ks, mask=ks < TOPK, other=-1)  # this token's entries
        tt = tl.arange(0, BT)[:, None]
        kk = tl.arange(0, KP)[None, :]
        earlier = tl.load(topk + tt * TOPK + kk, mask=(tt < t) & (kk < TOPK), other=-1)  # earlier tokens' ids
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
            if (c == 0) & ((e < -1) | (e >= E)):
                protocol.refuse_id(state, t * TOPK + k)
            if (e >= 0) & (e < E) & (again == 0):
                pos = tl.sum(tl.max((earlier == e).to(tl.int32), axis=1), axis=0)  # earlier tokens sent to e
                m = e // EL
                row = ((e % EL) * SIZE + me) * M + pos
                if FP8:
                    dst = ssl.data_ptr(sig, m, rows_off + base + row * H, tl.uint8)
                    tl.store(dst + col, vals, mask=live)
                    sdst = ssl.data_ptr(sig, m, scales_off + base + row * (H // _GROUP) * 4, tl.float32)
                    tl.store(sdst + c * (HB // _GROUP) + gs, sc, mask=c * HB + gs * _GROUP < H)
                else:
                    ELEM: tl.constexpr = x.dtype.element_ty.primitive_bitwidth // 8
                    dst = ssl.data_ptr(sig, m, rows_off + base + row * H * ELEM, x.dtype.element_ty)
                    tl.store(dst + col, vals, mask=live)
                if c == 0:
                    tl.store(ssl.data_ptr(sig, m, src_off + base + row * 8, tl.int64), t * TOPK + k)
    programs = tl.maximum(T, 1) * C
    ex = t * C + c  # this program's first expert to count
    if ex < E:
        tn = tl.arange(0, BT)[:, None]
        kn = tl.arange(0, KP)[None, :]
        ids = tl.load(topk + tn * TOPK + kn, mask=(tn < T) & (kn < TOPK), other=-1)  # every token's, loaded once
        while ex < E:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
            # a token counts once, however many of its entries name the expert
            n = tl.sum(tl.max((ids == ex).to(tl.int32), axis=1), axis=0).to(tl.int64)
            dst = ssl.data_ptr(sig, ex // EL, counts_off + base + ((ex % EL) * SIZE + me) * 8, tl.int64)
            tl.store(dst, n)
            ex += programs
    if protocol.arrive_last(state, _SENT, programs):
        protocol.keep_id(state, topk)
        protocol.notify(calls, sig, me, state, refused, _DISPATCH, SIZE, NSLOTS)


@triton.jit
def dispatch_read(
    recv, scales, counts_out, per_source, offsets, src, calls, state, sig, me, timeout_ns, record,
    rows_off, scales_off, src_off, counts_off, stride,
    SIZE: tl.constexpr, SP: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, EL: tl.constexpr,
    M: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, RB: tl.constexpr, FP8: tl.constexpr,
    G: tl.constexpr, GP: tl.constexpr,
):  # fmt: skip
    """Step 2 of a dispatch: program ``(e * SIZE + s, b)`` waits and checks the step
    (:func:`.protocol.check`) once, then copies blocks ``b, b + B, b + 2B ..`` (``B`` the grid's
    second axis) of ``RB`` rows of what member ``s`` sent local expert ``e`` to their packed
    places, ``recv[e][offsets[e][s] + j]`` (and their scales and source indices), as far as the
    rows ``s`` sent: the grid is sized by the device, not by ``max_tokens``, so that few programs
    wait. Program ``(e * SIZE, 0)`` stores ``e``'s counts, per source and in all, and the offsets
    (when the step failed: ``per_source`` -1, the counts and offsets 0: no rows, and its combine
    knows). The last program to arrive counts the step."""
    pid = tl.program_id(0)
    el = pid // SIZE
    s = pid % SIZE
    b = tl.program_id(1)
    step, status, who = protocol.check(calls, sig, me, timeout_ns, record, state, _DISPATCH, SIZE, NSLOTS, TRAP)
    ok = status == ssl.CALL_OK
    base = (step % 2) * stride
    own_counts = ssl.data_ptr(sig, me, counts_off + base, tl.int64)
    m, cnt = _sources(own_counts, el, SIZE, SP)
    cnt = tl.where(ok, cnt, 0)
    start = tl.sum(tl.where(m < s, cnt, 0), axis=0)
    n = tl.sum(tl.where(m == s, cnt, 0), axis=0)
    if (s == 0) & (b == 0):  # a failed step's per_source holds -1: its combine knows (y NaN, nothing sent)
        tl.store(per_source + el * SIZE + m, tl.where(ok, cnt, -1), mask=m < SIZE)
        tl.store(offsets + el * SIZE + m, tl.cumsum(cnt, axis=0) - cnt, mask=m < SIZE)
        tl.store(counts_out + el, tl.sum(cnt, axis=0))
    cols = tl.arange(0, HP)
    gs = tl.arange(0, GP)
    ELEM: tl.constexpr = recv.dtype.element_ty.primitive_bitwidth // 8
    first = ((el * SIZE + s) * M).to(tl.int64)  # int64: a member's region may pass 2 GiB
    rows = ssl.data_ptr(sig, me, rows_off + base + first * H * ELEM, recv.dtype.element_ty)
    srcs = ssl.data_ptr(sig, me, src_off + base + first * 8, tl.int64)
    scl = ssl.data_ptr(sig, me, scales_off + base + first * G * 4, tl.float32)
    blocks = tl.num_programs(1)
    while b * RB < n:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        for i in tl.static_range(RB):
            j = b * RB + i
            if j < n:
                to = el * (SIZE * M) + start + j
                tl.store(recv + to * H + cols, tl.load(rows + j * H + cols, mask=cols < H), mask=cols < H)
                if FP8:
                    tl.store(scales + to * G + gs, tl.load(scl + j * G + gs, mask=gs < G), mask=gs < G)
                tl.store(src + to, tl.load(srcs + j))
        b += blocks
    protocol.finish(calls, me, step, state, status, who, _DISPATCH, SIZE)


@triton.jit
def combine_send(
    out, per_source, offsets, src, refused, calls, state, sig, me, comb_off, stride,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, M: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
    RB: tl.constexpr,
):  # fmt: skip
    """Step 1 of a combine: program ``(e * SIZE + s, b)`` stores the expert's outputs for the blocks
    ``b, b + B, ..`` (``B`` the grid's second axis, sized by the device as a read's) of ``RB`` rows
    of member ``s``'s (packed from ``offsets[e][s]``), as far as the rows ``s`` sent, into ``s``'s
    combine region, at the row their source index names (token ``t``, entry ``k``). The last
    program to arrive notifies (:func:`.protocol.notify`)."""
    pid = tl.program_id(0)
    el = pid // SIZE
    s = pid % SIZE
    b = tl.program_id(1)
    base = protocol.parity(calls) * stride
    n = tl.load(per_source + el * SIZE + s)
    start = tl.load(offsets + el * SIZE + s)
    cols = tl.arange(0, HP)
    dst = ssl.data_ptr(sig, s, comb_off + base, out.dtype.element_ty)  # member s's region, looked up once
    while b * RB < n:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        for i in tl.static_range(RB):
            j = b * RB + i
            if j < n:
                row = el * (SIZE * M) + start + j
                slot = tl.load(src + row)
                tl.store(dst + slot * H + cols, tl.load(out + row * H + cols, mask=cols < H), mask=cols < H)
        b += tl.num_programs(1)
    if protocol.arrive_last(state, _SENT, tl.num_programs(0) * tl.num_programs(1)):
        protocol.notify(calls, sig, me, state, refused, _COMBINE, SIZE, NSLOTS)


@triton.jit
def combine_reduce(
    y, topk, weights, T, per_source, calls, state, sig, me, timeout_ns, record, comb_off, stride,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, E: tl.constexpr, H: tl.constexpr,
    HB: tl.constexpr, C: tl.constexpr, TOPK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Step 2 of a combine: each program waits and checks the step (:func:`.protocol.check`) once,
    then sums the (token ``t``, chunk ``c``) items ``i = t * C + c`` it is given (``i = p, p + P, ..``,
    ``P`` the grid, sized by the device as a read's: few programs wait) in float32, in the order
    ``k = 0 .. top_k - 1``: ``acc = acc + w[t, k] * out_k`` (``out_k`` the row its expert sent back;
    an entry naming the expert of an earlier entry reads that entry's row), then rounds once
    (NaN when the step failed, or the handle's dispatch did: its ``per_source`` holds -1, and no row
    was sent back). The last program to arrive counts the step."""
    step, status, who = protocol.check(calls, sig, me, timeout_ns, record, state, _COMBINE, SIZE, NSLOTS, TRAP)
    ok = (status == ssl.CALL_OK) & (tl.load(per_source) >= 0)  # and the handle's dispatch went well
    base = (step % 2) * stride
    own = ssl.data_ptr(sig, me, comb_off + base, y.dtype.element_ty)
    i = tl.program_id(0)
    while i < T * C:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        t = i // C
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
