"""The two kernels of :mod:`symmsync.gemm` and their tile protocol: one launch per call each.

Both run a persistent grid (one program a multiprocessor by default, one under Triton's
interpreter, which runs programs one after another). A call's *sends* (its header, and its
blocks of rows or partial sums) are units handed out by an atomic count (``claims``) to
whichever program asks first, so every send is made by a program that runs: no wait depends on
which programs are resident (a first version that gave each program its sends by its index
deadlocked under MPS; docs/gemm.md). A call's number ``c`` is the consumer kit's (counted on the
device); ``q = c % 2`` picks the copy of the regions. Signal slot 0 of every member carries the
header's release (``HDR``); slot ``1 + i`` the release of the ``i``-th block of tiles (a
*signal block*: ``RB`` rows, and for the reduce-scatter ``BAND`` column tiles). Every signal is
a ``SET`` of ``c + 1``, every wait a ``GE c + 1``: numbers the device computes, so a replayed
graph needs no reset.

All-gather + GEMM (member ``me`` of ``SIZE``; ``a`` its ``m`` rows, ``b`` its ``k x n``)::

    claimed units:  unit 0: post_call(c, m); block barrier; signal(p, HDR, c + 1) for every p
                    unit u: block u // SIZE of a's rows into member (me + u) % SIZE's region
                    [q][me] (its own first); block barrier; signal(it, 1 + block, c + 1)
                                                                  [release, system scope]
    every program:  wait(p, HDR, GE c + 1) for every p != me; status = check_call(c, m)
                    its share of the tiles of the gathered SIZE * m rows (its own first; a tile
                    may hold several members' rows): if status is OK, wait(s, 1 + block,
                    GE c + 1) for every block of every member s whose rows the tile holds (its
                    own too), then tile = those rows of regions [q][s] @ b (float32 sums);
                    else tile = NaN
                    end_call(c, status)  (every program; the last keeps a failure, counts c,
                    and resets the claims)

GEMM + reduce-scatter (``a`` is ``SIZE * m`` rows, block ``d`` the partial sum of member
``d``'s output rows; ``out`` this member's ``m x n``)::

    claimed units:  unit 0 as above; then, GROUPED (m <= RB): a tile of j members' rows (its
                    own too) @ a band of b's columns, each row's partial rounded to the dtype and
                    stored into its member's region [q][me]; block barrier; signal each of the
                    j members (1 + band); else: one signal block of one other member d's rows,
                    stored into d's region [q][me]; block barrier; signal(d, 1 + block, c + 1)
    every program:  wait HDRs; status = check_call(c, m)
                    its share of this member's signal blocks: if status is OK, wait for every
                    member's partial of the block (its own too when GROUPED); for each tile:
                    acc = P_0; acc += P_1; ... (float32, member order; P_me computed here, not
                    GROUPED); out = acc rounded to the dtype; else NaN
                    end_call(c, status)

Why a tile is read only once it is whole: its stores precede the block barrier and the
release of its signal; a reader acquires the signal's value before its loads (the
:func:`~symmsync.language.signal` contract). Why the members' verdicts agree: every program
reads every member's header only after acquiring that member's ``HDR`` release, which
follows the header's stores (the kit's argument, :mod:`symmsync.language.calls`); a refused
or differing call is seen by every program of every member before it reads a peer's tile,
so none waits for a tile that will never come (a refusing member sends none) and every
output of the call holds NaN. Why a region is never overwritten while a member reads it:
member ``s`` stores into ``r``'s region [q] for call ``c`` only after its own call ``c - 1``
ended, whose programs each waited for ``r``'s ``HDR`` of ``c - 1``; ``r`` signals that at
the start of its call ``c - 1``, after its call ``c - 2`` (the last reads of [q]) ended on
its stream. So a member is at most one call ahead of another, and writes the other copy.
``verify/gemm.pml`` checks this (and finds a tile read early without its wait, and a region
overwritten once a single copy is used).

A wait that times out or sees an abort fails closed: the program reads nothing more, stores
NaN, and the call ends ``WAIT_FAILED`` (the host raises; a GPU traps first).

Element types under Triton's interpreter: bfloat16 travels as its int16 bits (``BITS``) and
is widened and rounded on the bits (:mod:`symmsync.language.bf16`); float32 products are
taken in IEEE float32 on GPUs (``IEEE``), not TF32.
"""

from __future__ import annotations

import triton
import triton.language as tl

import symmsync.language as ssl
from symmsync.language.bf16 import from_f32, to_f32

#: The kind of call each consumer's header carries (each has one).
GATHER, SCATTER = 0, 1
#: Signal slot 0 of every member: the header's release; tiles' blocks from slot 1.
HDR = 0

_HDR = tl.constexpr(HDR)
_GATHER = tl.constexpr(GATHER)
_SCATTER = tl.constexpr(SCATTER)


@triton.jit
def _widen(x, BITS: tl.constexpr):
    # A loaded block as a dot takes it: bfloat16 bits widened under the interpreter, else as is.
    if BITS:
        x = to_f32(x, True)
    return x


@triton.jit
def _dot_rows(rows, live, b, sbk, sbn, col0, n, k, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr,
              IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):  # fmt: skip
    # The rows at ``rows`` (a pointer per row; rows not ``live`` masked) @ b's columns
    # [col0, col0 + BN): a float32 tile. EVEN_K, EVEN_N: k and n are multiples of BK and BN (no
    # mask along the contiguous dimensions: whole-vector loads).
    BM: tl.constexpr = rows.shape[0]
    rn = col0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = rows[:, None] + rk[None, :]
    yp = b + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k, BK):
        if EVEN_K:
            x = tl.load(xp, mask=live[:, None], other=0)
            if EVEN_N:
                y = tl.load(yp)
            else:
                y = tl.load(yp, mask=rn[None, :] < n, other=0)
        else:
            kk = k0 + rk
            x = tl.load(xp, mask=live[:, None] & (kk[None, :] < k), other=0)
            y = tl.load(yp, mask=(kk[:, None] < k) & (rn[None, :] < n), other=0)
        if IEEE:
            acc = tl.dot(_widen(x, BITS), _widen(y, BITS), acc, input_precision="ieee")
        else:
            acc = tl.dot(_widen(x, BITS), _widen(y, BITS), acc)
        xp += BK
        yp += BK * sbk
    return acc


@triton.jit
def _store_rows(rows, live, col0, n, acc, BN: tl.constexpr, BITS: tl.constexpr, EVEN_N: tl.constexpr):
    # acc rounded to the rows' element type into columns [col0, col0 + BN) of the rows at ``rows``.
    rn = col0 + tl.arange(0, BN)
    v = from_f32(acc, rows.dtype.element_ty, BITS)
    if EVEN_N:
        tl.store(rows[:, None] + rn[None, :], v, mask=live[:, None])
    else:
        tl.store(rows[:, None] + rn[None, :], v, mask=live[:, None] & (rn[None, :] < n))


@triton.jit
def _load_rows(rows, live, col0, n, BN: tl.constexpr, BITS: tl.constexpr, EVEN_N: tl.constexpr):
    # Columns [col0, col0 + BN) of the rows at ``rows``, widened to float32.
    rn = col0 + tl.arange(0, BN)
    if EVEN_N:
        v = tl.load(rows[:, None] + rn[None, :], mask=live[:, None])
    else:
        v = tl.load(rows[:, None] + rn[None, :], mask=live[:, None] & (rn[None, :] < n))
    return to_f32(v, BITS)


@triton.jit
def _rounded(acc, ELEM: tl.constexpr, BITS: tl.constexpr):
    # A float32 tile rounded to the element type and widened back: a partial as a peer reads it.
    return to_f32(from_f32(acc, ELEM, BITS), BITS)


@triton.jit
def _region(data, p, offset, first, width, ELEM: tl.constexpr):
    # Row ``first`` (elements of ``width`` per row) of the region at byte ``offset`` of member p.
    dst = tl.multiple_of(ssl.peer_ptr(data, p, offset, ELEM), 16)
    return dst + first.to(tl.int64) * width


@triton.jit
def _swizzled(u, tiles_m, tiles_n, GROUP: tl.constexpr):
    # Unit u's (row tile, column tile), GROUP row tiles at a time across the columns: programs
    # running together share GROUP row tiles and a few column tiles (read from L2, not memory).
    width = GROUP * tiles_n
    first = (u // width) * GROUP
    size = tl.minimum(tiles_m - first, GROUP)
    return first + (u % width) % size, (u % width) // size


@triton.jit
def parity(c):
    """Which copy of the regions call ``c`` uses."""
    return c % 2


@triton.jit
def wait_block(sig, me, s, block, c, timeout_ns, record, SIZE: tl.constexpr, NSLOTS: tl.constexpr,
               TRAP: tl.constexpr):  # fmt: skip
    """Wait until member ``s`` released signal block ``block`` of call ``c``: 0, or the failed wait's status."""
    return ssl.wait_signal(sig, me, s, 1 + block, c + 1, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)


@triton.jit
def start(calls, sig, me, c, KIND: tl.constexpr, m, refused, SIZE: tl.constexpr, NSLOTS: tl.constexpr):
    """The program that claims the call's first unit: this member's header of call ``c``, then its
    release to every member (``HDR``)."""
    ssl.post_call(calls, me, c, KIND, m, 0, 0, 0, refused, 0, 0, SIZE)
    tl.debug_barrier()  # every thread's header stores before the releases
    for p in tl.static_range(SIZE):
        ssl.signal(sig, me, p, _HDR, c + 1, ssl.SET, NSLOTS)


@triton.jit
def _claim(claims):
    # The next unit of the launch's sends, claimed by whichever program asks first.
    return tl.atomic_add(claims, 1, sem="relaxed", scope="gpu")


@triton.jit
def _end(calls, me, c, KIND: tl.constexpr, status, who, failed, claims, SIZE: tl.constexpr):
    # Every program: the kit's end of the call (the last one keeps a failure and counts the call),
    # and the last one resets the claims for the next launch (every program claimed its last).
    status = tl.where(failed != 0, ssl.WAIT_FAILED, status)
    if ssl.end_call(calls, me, c, KIND, status, tl.where(failed != 0, -1, who), SIZE, True):
        tl.atomic_xchg(claims, 0, sem="relaxed", scope="gpu")


@triton.jit
def verdict(calls, sig, me, c, KIND: tl.constexpr, m, refused, timeout_ns, record,
            SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """Every program: wait for every other member's header release, then the kit's check.
    Returns ``(status, who, failed)``: ``failed`` != 0 after a wait that timed out or saw an abort."""
    failed = tl.full((), 0, tl.int32)
    for p in tl.static_range(SIZE):
        if (p != me) & (failed == 0):
            failed += ssl.wait_signal(sig, me, p, _HDR, c + 1, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)
    status, who = ssl.check_call(calls, me, c, KIND, m, 0, 0, 0, refused, SIZE)
    return status, who, failed


@triton.jit
def _push_rows(a, data, sig, me, c, q, u, m, offset, max_rows, rr, cc, K: tl.constexpr, SIZE: tl.constexpr,
               NSLOTS: tl.constexpr, RB: tl.constexpr, CK: tl.constexpr):  # fmt: skip
    # Unit u of an all-gather's sends: block u // SIZE of this member's rows to member
    # (me + u) % SIZE's region [q][me], then its release.
    i = u // SIZE
    p = (me + u % SIZE) % SIZE
    dst = _region(data, p, offset, (q * SIZE + me) * max_rows, K, a.dtype.element_ty)
    rows = i * RB + rr
    for k0 in range(0, K, CK):
        at = rows[:, None] * K + (k0 + cc)[None, :]
        if K % CK == 0:
            mask = rows[:, None] < m
        else:
            mask = (rows[:, None] < m) & ((k0 + cc)[None, :] < K)
        tl.store(dst + at, tl.load(a + at, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's rows before the release
    ssl.signal(sig, me, p, 1 + i, c + 1, ssl.SET, NSLOTS)


@triton.jit
def all_gather_matmul(
    a, b, out, m, n, sbk, sbn, refused,
    calls, sig, me, timeout_ns, record, data, gathered, offset, max_rows, claims,
    K: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, RB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CK: tl.constexpr, BITS: tl.constexpr,
    IEEE: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """``out = cat(a_0, ..., a_{SIZE-1}) @ b``: every member's ``m x K`` rows, gathered in view
    order, times this member's ``K x n`` (strides ``sbk``, ``sbn``); the module's protocol."""
    EVEN_K: tl.constexpr = K % BK == 0
    c = ssl.call_number(calls)
    q = parity(c)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # 1. the header, then this member's rows into every member's region [q][me] (its own first), a
    # block at a time: units claimed by the programs running, so that none waits for one that is not
    blocks = tl.cdiv(m, RB)
    rr = tl.arange(0, RB)
    cc = tl.arange(0, CK)
    u = _claim(claims)
    while u <= blocks * SIZE:
        if u == 0:
            start(calls, sig, me, c, _GATHER, m, refused, SIZE, NSLOTS)
        else:
            _push_rows(a, data, sig, me, c, q, u - 1, m, offset, max_rows, rr, cc, K, SIZE, NSLOTS, RB, CK)
        u = _claim(claims)
    # 2. the verdict, then the tiles of the gathered rows (this member's own first), each after
    # the waits for the blocks of the members whose rows it holds
    status, who, failed = verdict(calls, sig, me, c, _GATHER, m, refused, timeout_ns, record, SIZE, NSLOTS, TRAP)
    good = status == ssl.CALL_OK
    total = SIZE * m
    tiles_m = tl.cdiv(total, BM)
    tiles_n = tl.cdiv(n, BN)
    first = (me * m) // BM
    lanes = tl.arange(0, BM)
    for u in range(pid, tiles_m * tiles_n, G):
        tm, tn = _swizzled(u, tiles_m, tiles_n, 8)
        tm = (first + tm) % tiles_m
        g0 = tm * BM
        g1 = tl.minimum(total, g0 + BM) - 1
        if good & (failed == 0):
            for s in range(g0 // m, g1 // m + 1):
                lo = tl.maximum(g0 - s * m, 0)
                hi = tl.minimum(g1 - s * m, m - 1)
                for blk in range(lo // RB, hi // RB + 1):
                    if failed == 0:
                        failed += wait_block(sig, me, s, blk, c, timeout_ns, record, SIZE, NSLOTS, TRAP)
        g = g0 + lanes
        live = g < total
        acc = tl.full((BM, BN), float("nan"), tl.float32)
        if good & (failed == 0):
            src = tl.where(live, g // m, 0)
            local = tl.where(live, g % m, 0)
            rows = gathered + ((q * SIZE + src) * max_rows + local).to(tl.int64) * K
            acc = _dot_rows(rows, live, b, sbk, sbn, tn * BN, n, K, BN, BK, BITS, IEEE, EVEN_K, EVEN_N)
        _store_rows(out + tl.where(live, g, 0).to(tl.int64) * n, live, tn * BN, n, acc, BN, BITS, EVEN_N)
    _end(calls, me, c, _GATHER, status, who, failed, claims, SIZE)


@triton.jit
def matmul_reduce_scatter(
    a, b, out, m, k, sbk, sbn, j, refused,
    calls, sig, me, timeout_ns, record, data, inbox, offset, max_rows, claims,
    N: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, RB: tl.constexpr,
    BAND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr,
    IEEE: tl.constexpr, GROUPED: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """``out`` = block ``me`` of ``sum over members of a_s @ b_s``: each member's ``SIZE * m x k``
    rows times its ``k x N``, each partial rounded to the dtype, summed in float32 in member
    order; the module's protocol. ``GROUPED`` (``m <= RB``): a tile holds the rows of ``j``
    members, so that ``b`` is read once per ``j`` members, and every partial (this member's own
    too) goes through the regions."""
    ELEM: tl.constexpr = a.dtype.element_ty
    EVEN_N: tl.constexpr = N % BN == 0
    tiles_n: tl.constexpr = (N + BN - 1) // BN
    NB: tl.constexpr = (tiles_n + BAND - 1) // BAND
    c = ssl.call_number(calls)
    q = parity(c)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    lanes = tl.arange(0, BM)
    mine = (q * SIZE + me) * max_rows
    blocks = tl.cdiv(m, RB)
    # 1. the header, then the partial sums: GROUPED, of every member's rows (its own too), j
    # members' rows a tile; else of every other member's rows, a signal block a unit; into the
    # member's region [q][me]. Units claimed by the programs running (none waits for one that is not).
    if GROUPED:
        units = tl.where(m > 0, tl.cdiv(SIZE, j), 0) * NB
    else:
        units = (SIZE - 1) * blocks * NB
    u = _claim(claims)
    while u <= units:
        if u == 0:
            start(calls, sig, me, c, _SCATTER, m, refused, SIZE, NSLOTS)
        elif GROUPED:
            v = u - 1
            band = v % NB
            g = (v // NB) * j * m + lanes
            live = g < tl.minimum(SIZE, (v // NB) * j + j) * m
            d = tl.where(live, g // m, 0)
            at = (mine + tl.where(live, g % m, 0)).to(tl.int64) * N * (a.dtype.element_ty.primitive_bitwidth // 8)
            dst = tl.multiple_of((tl.load(data + d) + offset + at).to(tl.pointer_type(ELEM)), 16)
            rows = a + tl.where(live, g, 0).to(tl.int64) * k
            for t in range(band * BAND, tl.minimum(tiles_n, band * BAND + BAND)):
                acc = _dot_rows(rows, live, b, sbk, sbn, t * BN, N, k, BN, BK, BITS, IEEE, EVEN_K, EVEN_N)
                _store_rows(dst, live, t * BN, N, acc, BN, BITS, EVEN_N)
            tl.debug_barrier()  # every thread's tiles before the releases
            for dd in range((v // NB) * j, tl.minimum(SIZE, (v // NB) * j + j)):
                ssl.signal(sig, me, dd, 1 + band, c + 1, ssl.SET, NSLOTS)
        else:
            v = u - 1
            d = (me + 1 + v // (blocks * NB)) % SIZE
            ib, band = _swizzled(v % (blocks * NB), blocks, NB, 8)
            dst = _region(data, d, offset, mine, N, ELEM)
            for row in range(ib * RB, tl.minimum(m, ib * RB + RB), BM):
                live = row + lanes < m
                rows = a + (d * m + tl.where(live, row + lanes, 0)).to(tl.int64) * k
                out_rows = dst + tl.where(live, row + lanes, 0).to(tl.int64) * N
                for t in range(band * BAND, tl.minimum(tiles_n, band * BAND + BAND)):
                    acc = _dot_rows(rows, live, b, sbk, sbn, t * BN, N, k, BN, BK, BITS, IEEE, EVEN_K, EVEN_N)
                    _store_rows(out_rows, live, t * BN, N, acc, BN, BITS, EVEN_N)
            tl.debug_barrier()  # every thread's tiles before the release
            ssl.signal(sig, me, d, 1 + ib * NB + band, c + 1, ssl.SET, NSLOTS)
        u = _claim(claims)
    # 2. the verdict, then this member's rows: the members' partials summed in member order
    status, who, failed = verdict(calls, sig, me, c, _SCATTER, m, refused, timeout_ns, record, SIZE, NSLOTS, TRAP)
    good = status == ssl.CALL_OK
    for u in range(pid, blocks * NB, G):
        ib, band = _swizzled(u, blocks, NB, 8)
        i = ib * NB + band
        for s in tl.static_range(SIZE):
            if good & (failed == 0) & ((s != me) | GROUPED):
                failed += wait_block(sig, me, s, i, c, timeout_ns, record, SIZE, NSLOTS, TRAP)
        r0 = ib * RB
        t0 = band * BAND
        for row in range(r0, tl.minimum(m, r0 + RB), BM):
            live = row + lanes < m
            local = tl.where(live, row + lanes, 0)
            for t in range(t0, tl.minimum(tiles_n, t0 + BAND)):
                total = tl.full((BM, BN), float("nan"), tl.float32)
                if good & (failed == 0):
                    if not GROUPED:
                        rows = a + (me * m + local).to(tl.int64) * k
                        own = _dot_rows(rows, live, b, sbk, sbn, t * BN, N, k, BN, BK, BITS, IEEE, EVEN_K, EVEN_N)
                        own = _rounded(own, ELEM, BITS)
                    for s in tl.static_range(SIZE):
                        if GROUPED:
                            part = _load_rows(inbox + ((q * SIZE + s) * max_rows + local).to(tl.int64) * N, live,
                                              t * BN, N, BN, BITS, EVEN_N)  # fmt: skip
                        else:
                            part = own
                            if s != me:
                                part = _load_rows(inbox + ((q * SIZE + s) * max_rows + local).to(tl.int64) * N,
                                                  live, t * BN, N, BN, BITS, EVEN_N)  # fmt: skip
                        if s == 0:
                            total = part
                        else:
                            total = total + part
                _store_rows(out + local.to(tl.int64) * N, live, t * BN, N, total, BN, BITS, EVEN_N)
    _end(calls, me, c, _SCATTER, status, who, failed, claims, SIZE)
