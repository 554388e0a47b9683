"""The collectives' kernel: copy in, hand over (:mod:`.protocol`), sum or copy out.

One kernel source serves every operation, picked by compile-time constants: the
all-reduce (one-shot or two-shot), the all-gather and the reduce-scatter, each with
its input copied into the workspace or already there (``SYMMETRIC``). Its programs
share the elements in blocks of ``BLOCK``, program ``k`` taking blocks ``k, k + G, ...``
in every phase, so that under the interpreter one program does the whole call.

Sums are float32, in member order (0, 1, ..., size - 1), starting from member 0's
value, so every member (and both all-reduce algorithms) produce the same bits:
``sum = x_0; sum += x_1; ...; round once to the dtype`` (round to nearest even).
Under Triton's interpreter (numpy has no bfloat16) bfloat16 travels as its int16
bits and is converted with integer arithmetic that rounds as torch does
(:mod:`symmsync.language.bf16`).
"""

from __future__ import annotations

import triton
import triton.language as tl

import symmsync.language as ssl
from symmsync.language.bf16 import from_f32, to_f32

from . import layout as L
from . import protocol

_ALL_REDUCE = tl.constexpr(L.ALL_REDUCE)
_ALL_GATHER = tl.constexpr(L.ALL_GATHER)
_CHUNK_ALIGN = tl.constexpr(L.CHUNK_ALIGN)
_REDUCE_SCATTER = tl.constexpr(L.REDUCE_SCATTER)


@triton.jit
def _spread(go, idx):
    # A uniform flag as a block mask. (Under the interpreter of triton 3.9 a mask that is a
    # block ANDed with a scalar flag has an unsupported dtype; a full block ANDed with it has not.)
    return tl.full(idx.shape, 1, tl.int1) & go


@triton.jit
def _copy_block(dst, src, idx, n, go, FULL: tl.constexpr):
    # ``go`` (uniform) holds back the stores, never the loads.
    if FULL:  # no mask but go: loads and stores of 16 bytes per thread where the pointers allow
        tl.store(dst + idx, tl.load(src + idx), mask=_spread(go, idx))
    else:
        m = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m & _spread(go, idx))


@triton.jit
def _copy(dst, src, n, pid, G, go, BLOCK: tl.constexpr):
    """``dst[i] = src[i]`` for ``i < n``: this program's blocks (pid, pid + G, ...); stored only if ``go``."""
    lanes = tl.arange(0, BLOCK)
    b = pid
    while b * BLOCK < n:
        idx = b * BLOCK + lanes
        if (b + 1) * BLOCK <= n:
            _copy_block(dst, src, idx, n, go, True)
        else:
            _copy_block(dst, src, idx, n, go, False)
        b += G


@triton.jit
def _sum_block(
    ptrs, src, first, idx, n, ELEM: tl.constexpr, SIZE: tl.constexpr, BF16_BITS: tl.constexpr, FULL: tl.constexpr
):
    # Member order, from member 0's value: the same bits on every member and algorithm.
    # ``src`` is a slot's (aligned) byte offset, ``first`` the element the block starts from.
    m = idx < n
    base = tl.multiple_of(ssl.peer_ptr(ptrs, 0, src, ELEM), 16) + first
    if FULL:
        acc = to_f32(tl.load(base + idx), BF16_BITS)
    else:
        acc = to_f32(tl.load(base + idx, mask=m, other=0), BF16_BITS)
    for p in tl.static_range(1, SIZE):
        base = tl.multiple_of(ssl.peer_ptr(ptrs, p, src, ELEM), 16) + first
        if FULL:
            acc += to_f32(tl.load(base + idx), BF16_BITS)
        else:
            acc += to_f32(tl.load(base + idx, mask=m, other=0), BF16_BITS)
    return from_f32(acc, ELEM, BF16_BITS)


@triton.jit
def _store_block(dst, idx, v, n, go, FULL: tl.constexpr):
    if FULL:
        tl.store(dst + idx, v, mask=_spread(go, idx))
    else:
        tl.store(dst + idx, v, mask=(idx < n) & _spread(go, idx))


@triton.jit
def _reduce(
    ptrs,
    src,
    first,
    n,
    dst,
    dst2,
    pid,
    G,
    go,
    ELEM: tl.constexpr,
    SIZE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    TWO: tl.constexpr,
):
    """``dst[i]`` (and ``dst2[i]``) ``= sum over members p of element first + i of p's slot at src``, i < n."""
    lanes = tl.arange(0, BLOCK)
    b = pid
    while b * BLOCK < n:
        idx = b * BLOCK + lanes
        if (b + 1) * BLOCK <= n:
            v = _sum_block(ptrs, src, first, idx, n, ELEM, SIZE, BF16_BITS, True)
            _store_block(dst, idx, v, n, go, True)
            if TWO:
                _store_block(dst2, idx, v, n, go, True)
        else:
            v = _sum_block(ptrs, src, first, idx, n, ELEM, SIZE, BF16_BITS, False)
            _store_block(dst, idx, v, n, go, False)
            if TWO:
                _store_block(dst2, idx, v, n, go, False)
        b += G


@triton.jit
def _rmsnorm_rows(
    ptrs,
    src,
    numel,
    hidden,
    out,
    residual,
    weight,
    res_out,
    eps,
    pid,
    G,
    go,
    ELEM: tl.constexpr,
    SIZE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    ROW: tl.constexpr,
):
    """The fused epilogue, one row of ``hidden`` elements per step (program ``pid`` takes rows
    ``pid, pid + G, ...``)::

        s = dtype(member-order float32 sum)                  # the all-reduce's own result
        res_out = dtype(float32(s) + float32(residual))      # what torch's ``s + residual`` gives
        h = float32(res_out)
        out = dtype(h * rsqrt(mean(h * h) + eps) * float32(weight))
    """
    cols = tl.arange(0, ROW)
    cm = cols < hidden
    w = to_f32(tl.load(weight + cols, mask=cm, other=0), BF16_BITS)
    rows = numel // hidden
    r = pid
    while r < rows:
        first = r * hidden
        s = _sum_block(ptrs, src, first, cols, hidden, ELEM, SIZE, BF16_BITS, False)
        h = to_f32(s, BF16_BITS) + to_f32(tl.load(residual + first + cols, mask=cm, other=0), BF16_BITS)
        new_res = from_f32(h, ELEM, BF16_BITS)
        hr = tl.where(cm, to_f32(new_res, BF16_BITS), 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(hr * hr, axis=0) / hidden + eps)
        keep = cm & _spread(go, cols)
        tl.store(res_out + first + cols, new_res, mask=keep)
        tl.store(out + first + cols, from_f32(hr * inv * w, ELEM, BF16_BITS), mask=keep)
        r += G


@triton.jit
def _fill_nan(dst, n, pid, G, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """``dst[i] = NaN`` for ``i < n``: this program's blocks (a failed call's poison)."""
    ELEM: tl.constexpr = dst.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    nan = from_f32(tl.full([BLOCK], float("nan"), tl.float32), ELEM, BF16_BITS)
    b = pid
    while b * BLOCK < n:
        idx = b * BLOCK + lanes
        tl.store(dst + idx, nan, mask=idx < n)
        b += G


@triton.jit
def _sizes(count, SIZE: tl.constexpr, OP: tl.constexpr):
    # (numel, chunk) of a call of ``count`` (the reduce-scatter passes its chunk, so that Triton
    # specializes the chunk's alignment, 16-byte accesses, as it does any argument's).
    if OP == _REDUCE_SCATTER:
        numel = count * SIZE
        chunk = count
    else:
        numel = count
        # two-shot: a member's chunk, cdiv(numel, SIZE) rounded up to whole 16-byte groups
        chunk = ((count + SIZE - 1) // SIZE + _CHUNK_ALIGN - 1) // _CHUNK_ALIGN * _CHUNK_ALIGN
    return numel, chunk


@triton.jit
def _hand_over(
    x,
    count,
    refused,
    calls,
    n,
    ptrs,
    sptrs,
    cell,
    me,
    timeout_ns,
    record,
    e,
    src,
    counter,
    ep,
    hidden,
    pid,
    G,
    SIZE: tl.constexpr,
    OP: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK: tl.constexpr,
    TRAP: tl.constexpr,
    DTYPE_CODE: tl.constexpr,
    ALGORITHM: tl.constexpr,
    PHASES: tl.constexpr,
):
    # The first half of a call (.protocol's pseudocode): copy in, the call header, arrive, wait.
    # Returns (numel, chunk, ok: every member published this call's epoch).
    ELEM: tl.constexpr = x.dtype.element_ty
    numel, chunk = _sizes(count, SIZE, OP)
    if not SYMMETRIC:  # copy in: this member's input into its own slot
        _copy(tl.multiple_of(ssl.peer_ptr(ptrs, me, src, ELEM), 16), x, numel, pid, G, pid >= 0, BLOCK)
    if pid == 0:  # the call's header, to every member (released by the publish of the last to arrive)
        ssl.post_call(calls, me, n, OP, numel, DTYPE_CODE + 256 * SYMMETRIC, ALGORITHM, hidden, refused, 0, 0, SIZE)
    protocol.arrive(counter, ep, G - 1, sptrs, cell, me, SIZE, PHASES == 1)  # (n, e): neither needed
    ok = protocol.wait(sptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)
    return numel, chunk, ok


@triton.jit
def _verdict(
    calls,
    n,
    numel,
    refused,
    hidden,
    me,
    counter,
    G,
    e,
    timeout_ns,
    mism,
    SIZE: tl.constexpr,
    OP: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    TRAP: tl.constexpr,
    DTYPE_CODE: tl.constexpr,
    ALGORITHM: tl.constexpr,
    PHASES: tl.constexpr,
):
    # After a wait that returned: (go: every member's call is this one and nobody refused it;
    # status and who: the call's, for end_call). A refused or differing call is the same on every
    # member (each compares every member's header), so each reads nothing and makes no second
    # phase, and the arrival counter is reset for the next call. The verdict is loads only: a
    # one-phase call issues its first payload loads while the header loads are in flight and
    # stores nothing unless ``go``. Two phases: then the grid barrier.
    status, who = ssl.check_call(
        calls, me, n, OP, numel, DTYPE_CODE + 256 * SYMMETRIC, ALGORITHM, hidden, refused, SIZE
    )
    go = status == ssl.CALL_OK
    if PHASES == 2:
        if go:
            go = protocol.grid_barrier(counter, G, e, timeout_ns, mism, me, SIZE, TRAP)
            status = tl.where(go, status, ssl.WAIT_FAILED)
        elif tl.program_id(0) == 0:  # every program arrived (the publish came after the last)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return go, status, who


@triton.jit
def _read_members(
    out,
    ptrs,
    sptrs,
    cell,
    me,
    timeout_ns,
    record,
    e,
    src,
    counter,
    ep,
    reduced,
    residual,
    weight,
    res_out,
    hidden,
    eps,
    numel,
    chunk,
    go,
    pid,
    G,
    SIZE: tl.constexpr,
    OP: tl.constexpr,
    TWO_SHOT: tl.constexpr,
    BLOCK: tl.constexpr,
    TRAP: tl.constexpr,
    BF16_BITS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ROW: tl.constexpr,
    PHASES: tl.constexpr,
):
    # The second half of a call that may run: read (sum or copy) the members' inputs, storing only
    # if ``go``, and (two phases) the second publish and wait. Returns whether that wait returned.
    ELEM: tl.constexpr = out.dtype.element_ty
    if OP == _ALL_REDUCE:
        if EPILOGUE:  # one-shot with the residual add and the RMS norm: whole rows per program
            _rmsnorm_rows(
                ptrs,
                src,
                numel,
                hidden,
                out,
                residual,
                weight,
                res_out,
                eps,
                pid,
                G,
                go,
                ELEM,
                SIZE,
                BF16_BITS,
                ROW,
            )
        elif TWO_SHOT:  # reduce this member's chunk into its reduced slot (and the output)
            lo = me * chunk
            n = tl.maximum(tl.minimum(numel, lo + chunk) - lo, 0)
            red = tl.multiple_of(ssl.peer_ptr(ptrs, me, reduced, ELEM), 16)
            _reduce(ptrs, src, lo, n, red, out + lo, pid, G, go, ELEM, SIZE, BF16_BITS, BLOCK, True)
        else:
            _reduce(ptrs, src, 0, numel, out, out, pid, G, go, ELEM, SIZE, BF16_BITS, BLOCK, False)
    elif OP == _ALL_GATHER:
        for p in tl.static_range(SIZE):
            theirs = tl.multiple_of(ssl.peer_ptr(ptrs, p, src, ELEM), 16)
            _copy(out + p * numel, theirs, numel, pid, G, go, BLOCK)
    else:  # reduce-scatter: this member's chunk of every member's input
        _reduce(ptrs, src, me * chunk, chunk, out, out, pid, G, go, ELEM, SIZE, BF16_BITS, BLOCK, False)
    waited = pid >= 0
    if PHASES == 2:
        n_in, _e = protocol.arrive(counter, ep, 2 * G - 1, sptrs, cell, me, SIZE, True)
        if TWO_SHOT:  # every program: gather the other members' reduced chunks
            waited = protocol.wait(sptrs, cell, me, e + 1, timeout_ns, record, SIZE, TRAP)
            if waited:
                for p in tl.static_range(SIZE):
                    if p != me:
                        lo = p * chunk
                        n = tl.maximum(tl.minimum(numel, lo + chunk) - lo, 0)
                        theirs = tl.multiple_of(ssl.peer_ptr(ptrs, p, reduced, ELEM), 16)
                        _copy(out + lo, theirs, n, pid, G, go, BLOCK)
        else:  # symmetric input: the kernel ends once every member finished reading it
            if n_in == 2 * G - 1:
                waited = protocol.wait(sptrs, cell, me, e + 1, timeout_ns, record, SIZE, TRAP)
    return waited


@triton.jit
def _poison(out, res_out, numel, chunk, pid, G, SIZE: tl.constexpr, OP: tl.constexpr, BF16_BITS: tl.constexpr,
            BLOCK: tl.constexpr, EPILOGUE: tl.constexpr):  # fmt: skip
    # A failed call's outputs read NaN on every member (this program's blocks of them).
    if OP == _ALL_REDUCE:
        _fill_nan(out, numel, pid, G, BF16_BITS, BLOCK)
        if EPILOGUE:
            _fill_nan(res_out, numel, pid, G, BF16_BITS, BLOCK)
    elif OP == _ALL_GATHER:
        _fill_nan(out, SIZE * numel, pid, G, BF16_BITS, BLOCK)
    else:
        _fill_nan(out, chunk, pid, G, BF16_BITS, BLOCK)


@triton.jit
def collective_kernel(
    x,
    out,
    count,  # elements of the call's input (reduce-scatter: of each member's chunk)
    refused,  # the call's refusal code (symmsync.language.calls): 0, or this member's refusal
    calls,  # the collective's call headers (Consumer.calls)
    ptrs,  # the view's pointer table (payload)
    sptrs,
    cell,
    me,
    timeout_ns,
    record,  # the fence's arguments (Fence.kernel_args)
    mism,  # the collective's own record (a grid barrier that stalled)
    counter_off,
    inputs,
    input_stride,
    symmetric,
    reduced,  # workspace offsets (layout.Workspace)
    residual,
    weight,
    res_out,
    hidden,
    eps,  # the fused epilogue (EPILOGUE only)
    SIZE: tl.constexpr,
    OP: tl.constexpr,
    TWO_SHOT: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK: tl.constexpr,
    TRAP: tl.constexpr,
    BF16_BITS: tl.constexpr,
    DTYPE_CODE: tl.constexpr,
    ALGORITHM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ROW: tl.constexpr,
):
    """One call of a collective on this member (the pseudocode of :mod:`.protocol`).

    Its parts are :func:`_hand_over` (copy in, call header, arrive, wait), :func:`_verdict` (the
    headers, the grid barrier), :func:`_read_members` and :func:`_poison`, so that a test can build
    a variant of this kernel from them (a stall before the reads, or input slots without the
    parity) and launch it through the seam :data:`symmsync.collectives.operations.KERNEL`.
    """
    PHASES: tl.constexpr = 2 if (TWO_SHOT or SYMMETRIC) else 1
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = protocol.next_epoch(sptrs, cell, me)
    n = ssl.call_number(calls)
    if protocol.closed(e):  # launched through arguments kept past close(): it fails, and does nothing else
        protocol.fail_closed(sptrs, cell, me, e, record, SIZE, TRAP)
    else:
        if SYMMETRIC:
            src = symmetric + e * 0
        else:
            src = inputs + (e % 2) * input_stride  # the input slot of this call's parity
        counter = ssl.peer_ptr(ptrs, me, counter_off, tl.int64)
        ep = ssl.epoch_ptr(sptrs, cell, me)
        numel, chunk, ok = _hand_over(
            x, count, refused, calls, n, ptrs, sptrs, cell, me, timeout_ns, record, e, src, counter, ep, hidden, pid,
            G, SIZE, OP, SYMMETRIC, BLOCK, TRAP, DTYPE_CODE, ALGORITHM, PHASES,
        )  # fmt: skip
        status = tl.full((), ssl.WAIT_FAILED, tl.int64)
        who = tl.full((), -1, tl.int64)
        go = ok & False
        if ok:
            go, status, who = _verdict(
                calls, n, numel, refused, hidden, me, counter, G, e, timeout_ns, mism,
                SIZE, OP, SYMMETRIC, TRAP, DTYPE_CODE, ALGORITHM, PHASES,
            )  # fmt: skip
            if go | (PHASES == 1):  # one phase: its loads go out before the verdict arrives (stores held)
                waited = _read_members(
                    out, ptrs, sptrs, cell, me, timeout_ns, record, e, src, counter, ep, reduced,
                    residual, weight, res_out, hidden, eps, numel, chunk, go, pid, G,
                    SIZE, OP, TWO_SHOT, BLOCK, TRAP, BF16_BITS, EPILOGUE, ROW, PHASES,
                )  # fmt: skip
                status = tl.where(waited, status, ssl.WAIT_FAILED)
        if not go:
            _poison(out, res_out, numel, chunk, pid, G, SIZE, OP, BF16_BITS, BLOCK, EPILOGUE)
        ssl.end_call(calls, me, n, OP, status, who, SIZE, True)
