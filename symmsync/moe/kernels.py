"""The dispatcher's kernels: three launches per step (:mod:`.protocol` says why and in what order),
each bound once (:mod:`symmsync.core.launch`).

Placement, computed by the sender with a prefix count (no atomics): token ``t`` of member
``s`` routed to expert ``e`` (owned by member ``e // EL`` as its local expert ``e % EL``) lands
in row ``s * M + p`` of that expert, ``p`` the number of tokens ``t' < t`` of ``s`` routed to
``e``. An entry ``topk_idx[t, k]`` is skipped when it is negative or not below the number of
experts (the host refuses such ids in eager calls), and when an earlier entry of the same
token names the same expert: a (token, expert) pair is sent once.

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
_OK = tl.constexpr(protocol.OK)


@triton.jit
def _first(topk, t, k, E: tl.constexpr, TOPK: tl.constexpr):
    """``(e, sent)``: entry ``k`` of token ``t``, and whether it is sent (a valid id that no
    earlier entry of the token names)."""
    e = tl.load(topk + t * TOPK + k)
    sent = (e >= 0) & (e < E)
    for j in tl.static_range(k):
        sent = sent & (tl.load(topk + t * TOPK + j) != e)
    return e, sent


@triton.jit
def dispatch_send(
    x, topk, T, state, sig, me,
    rows_off, scales_off, src_off, stride,
    SIZE: tl.constexpr, E: tl.constexpr, EL: tl.constexpr, M: tl.constexpr, H: tl.constexpr,
    HP: tl.constexpr, TOPK: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr,
    FP8: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Step 1 of a dispatch: program ``t`` stores token ``t``'s row (and its fp8 scales) and its
    source index into the region of each expert it is routed to."""
    t = tl.program_id(0)
    if t < T:
        base = protocol.parity(state) * stride
        tt = tl.arange(0, BT)[:, None]
        kk = tl.arange(0, KP)[None, :]
        routes = tl.load(topk + tt * TOPK + kk, mask=(tt < T) & (kk < TOPK), other=-1)
        earlier = tt < t
        for k in tl.static_range(TOPK):
            e, sent = _first(topk, t, k, E, TOPK)
            if sent:
                pos = tl.sum(tl.max(((routes == e) & earlier).to(tl.int32), axis=1), axis=0)
                m = e // EL
                row = ((e % EL) * SIZE + me) * M + pos
                if FP8:
                    g = tl.arange(0, GP)[:, None]
                    c = tl.arange(0, _GROUP)[None, :]
                    live = (g < G) & (c < _GROUP)
                    v = to_f32(tl.load(x + t * H + g * _GROUP + c, mask=live, other=0), BITS)
                    amax = tl.max(tl.abs(v), axis=1)
                    s = tl.math.div_rn(tl.maximum(amax, _FLOOR), _FP8_MAX)
                    codes = to_e4m3(tl.math.div_rn(v, s[:, None]))
                    dst = ssl.data_ptr(sig, m, rows_off + base + row * H, tl.uint8)
                    tl.store(dst + g * _GROUP + c, codes, mask=live)
                    gs = tl.arange(0, GP)
                    sdst = ssl.data_ptr(sig, m, scales_off + base + row * G * 4, tl.float32)
                    tl.store(sdst + gs, s, mask=gs < G)
                else:
                    cols = tl.arange(0, HP)
                    v = tl.load(x + t * H + cols, mask=cols < H)
                    ELEM: tl.constexpr = x.dtype.element_ty.primitive_bitwidth // 8
                    dst = ssl.data_ptr(sig, m, rows_off + base + row * H * ELEM, x.dtype.element_ty)
                    tl.store(dst + cols, v, mask=cols < H)
                tl.store(ssl.data_ptr(sig, m, src_off + base + row * 8, tl.int64), t * TOPK + k)


@triton.jit
def dispatch_notify(
    topk, T, state, sig, me, timeout_ns, record, counts_off, stride, headers_off,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, E: tl.constexpr, EL: tl.constexpr,
    TOPK: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """Step 2 of a dispatch (one program): every receiver's count of this member's rows for each
    of its local experts (zeros too), then :func:`.protocol.notify_and_wait`."""
    base = protocol.parity(state) * stride
    tt = tl.arange(0, BT)
    for m in tl.static_range(SIZE):
        for el in tl.static_range(EL):
            e = m * EL + el
            hit = tl.zeros([BT], dtype=tl.int32)
            for k in tl.static_range(TOPK):
                hit = hit | (tl.load(topk + tt * TOPK + k, mask=tt < T, other=-1) == e).to(tl.int32)
            n = tl.sum(hit, axis=0).to(tl.int64)
            tl.store(ssl.data_ptr(sig, m, counts_off + base + (el * SIZE + me) * 8, tl.int64), n)
    protocol.notify_and_wait(sig, me, timeout_ns, record, state, headers_off, _DISPATCH, SIZE, NSLOTS, TRAP)


@triton.jit
def dispatch_read(
    recv, scales, per_source, src, state, sig, me,
    rows_off, scales_off, src_off, counts_off, stride,
    SIZE: tl.constexpr, M: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
    FP8: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
):  # fmt: skip
    """Step 3 of a dispatch: program ``(e, s)`` copies what member ``s`` sent local expert ``e``
    out of this member's region: rows ``s * M + j`` for ``j`` below its count, zeros past it
    (and source index -1), and the count."""
    pid = tl.program_id(0)
    el = pid // SIZE
    s = pid % SIZE
    base = protocol.finished_parity(state) * stride
    ok = protocol.status(state) == _OK
    n = tl.where(ok, tl.load(ssl.data_ptr(sig, me, counts_off + base + (el * SIZE + s) * 8, tl.int64)), 0)
    tl.store(per_source + el * SIZE + s, n)
    cols = tl.arange(0, HP)
    gs = tl.arange(0, GP)
    ELEM: tl.constexpr = recv.dtype.element_ty.primitive_bitwidth // 8
    first = (el * SIZE + s) * M
    # this member's own region, looked up once (each lookup checks its index)
    rows = ssl.data_ptr(sig, me, rows_off + base + first * H * ELEM, recv.dtype.element_ty)
    srcs = ssl.data_ptr(sig, me, src_off + base + first * 8, tl.int64)
    scl = ssl.data_ptr(sig, me, scales_off + base + first * G * 4, tl.float32)
    for j in range(M):
        live = j < n
        width = tl.where(live, H, 0)  # past the count: nothing read, zeros stored
        v = tl.load(rows + j * H + cols, mask=cols < width, other=0)
        tl.store(recv + (first + j) * H + cols, v, mask=cols < H)
        if FP8:
            sv = tl.load(scl + j * G + gs, mask=gs < tl.where(live, G, 0), other=0.0)
            tl.store(scales + (first + j) * G + gs, sv, mask=gs < G)
        tl.store(src + first + j, tl.where(live, tl.load(srcs + j), -1))


@triton.jit
def combine_send(
    out, per_source, src, state, sig, me, comb_off, stride,
    SIZE: tl.constexpr, M: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """Step 1 of a combine: program ``(e, s)`` stores the expert's outputs for member ``s``'s rows
    into ``s``'s combine region, at the row its source index names (token ``t``, entry ``k``)."""
    pid = tl.program_id(0)
    el = pid // SIZE
    s = pid % SIZE
    base = protocol.parity(state) * stride
    n = tl.load(per_source + el * SIZE + s)
    cols = tl.arange(0, HP)
    dst = ssl.data_ptr(sig, s, comb_off + base, out.dtype.element_ty)  # member s's region, looked up once
    for j in range(n):
        row = (el * SIZE + s) * M + j
        slot = tl.load(src + row)
        v = tl.load(out + row * H + cols, mask=cols < H)
        tl.store(dst + slot * H + cols, v, mask=cols < H)


@triton.jit
def combine_notify(
    state, sig, me, timeout_ns, record, headers_off,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
):  # fmt: skip
    """Step 2 of a combine (one program): :func:`.protocol.notify_and_wait`."""
    protocol.notify_and_wait(sig, me, timeout_ns, record, state, headers_off, _COMBINE, SIZE, NSLOTS, TRAP)


@triton.jit
def combine_reduce(
    y, topk, weights, T, state, sig, me, comb_off, stride,
    E: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, TOPK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Step 3 of a combine: program ``t`` sums token ``t``'s contributions in float32, in the order
    ``k = 0 .. top_k - 1``: ``acc = acc + w[t, k] * out_k`` (``out_k`` the row its expert sent back;
    an entry naming the expert of an earlier entry reads that entry's row), then rounds once."""
    t = tl.program_id(0)
    if t < T:
        base = protocol.finished_parity(state) * stride
        ok = protocol.status(state) == _OK
        cols = tl.arange(0, HP)
        acc = tl.zeros([HP], dtype=tl.float32)
        own = ssl.data_ptr(sig, me, comb_off + base, y.dtype.element_ty)
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
        tl.store(y + t * H + cols, from_f32(acc, y.dtype.element_ty, BITS), mask=cols < H)
