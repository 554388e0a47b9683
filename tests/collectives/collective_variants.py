"""A variant of the collectives' kernel, built only here, for the back-to-back tests.

:func:`stalling_kernel` is :func:`symmsync.collectives.kernels.collective_kernel` (the same
signature, the same parts, ``_hand_over``, ``_verdict``, ``_read_members`` and ``_poison``) with two changes the
tests steer per call through :data:`CONTROL`, a host tensor the kernel reads (the tests run
on the host backend, where a kernel reads host memory):

* ``CONTROL[0]``: nanoseconds this member stalls between its wait and its reads, so that a
  fast member runs ahead into its next call;
* ``CONTROL[1]``: input slots in turn, 2 as shipped (by epoch parity) or 1 (the parity
  removed: a fast member's next copy-in lands in the slot a slow one still reads), which the
  back-to-back oracle must catch.

A test puts it in through the seam the package documents,
:data:`symmsync.collectives.operations.KERNEL`, before it constructs its operations.

:func:`no_wait` is :func:`symmsync.collectives.protocol.wait` with the wait removed (it returns
True at once): a test puts it in ``protocol``'s place in one rank process, where the
interpreter resolves ``protocol.wait`` when the kernel runs, to show the all-reduce's
oracle catches a member that reads without waiting.
"""

import torch
import triton
import triton.language as tl
from helpers import spin

import symmsync.language as ssl
from symmsync.collectives import kernels as K
from symmsync.collectives import protocol

CONTROL = torch.tensor([0, 2], dtype=torch.int64)
"""[stall ns, input slots]: set by the test before each call (one process per rank)."""
_CONTROL = tl.constexpr(CONTROL.data_ptr())  # the tensor lives as long as the process


@triton.jit
def no_wait(sptrs, cell, me, epoch, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """``protocol.wait``'s signature; waits for nothing and reports success."""
    return me >= 0


@triton.jit
def stalling_kernel(
    x,
    out,
    count,
    refused,
    calls,
    ptrs,
    sptrs,
    cell,
    me,
    timeout_ns,
    record,
    mism,
    counter_off,
    inputs,
    input_stride,
    symmetric,
    reduced,
    residual,
    weight,
    res_out,
    hidden,
    eps,
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
    control = tl.full([], _CONTROL, tl.int64).to(tl.pointer_type(tl.int64))
    PHASES: tl.constexpr = 2 if (TWO_SHOT or SYMMETRIC) else 1
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    e = protocol.next_epoch(sptrs, cell, me)
    n = ssl.call_number(calls)
    if SYMMETRIC:
        src = symmetric + e * 0
    else:
        src = inputs + (e % tl.load(control + 1)) * input_stride  # the change: 1 slot or 2
    counter = ssl.peer_ptr(ptrs, me, counter_off, tl.int64)
    ep = ssl.epoch_ptr(sptrs, cell, me)
    numel, chunk, ok = K._hand_over(
        x, count, refused, calls, n, ptrs, sptrs, cell, me, timeout_ns, record, e, src, counter, ep, hidden, pid, G,
        SIZE, OP, SYMMETRIC, BLOCK, TRAP, DTYPE_CODE, ALGORITHM, PHASES,
    )  # fmt: skip
    status = tl.full((), ssl.WAIT_FAILED, tl.int64)
    who = tl.full((), -1, tl.int64)
    go = ok & False
    if ok:
        go, status, who = K._verdict(
            calls, n, numel, refused, hidden, me, counter, G, e, timeout_ns, mism,
            SIZE, OP, SYMMETRIC, TRAP, DTYPE_CODE, ALGORITHM, PHASES,
        )  # fmt: skip
        if go | (PHASES == 1):
            spin(tl.load(control))  # the change: hold this member between its wait and its reads
            waited = K._read_members(
                out, ptrs, sptrs, cell, me, timeout_ns, record, e, src, counter, ep, reduced, residual,
                weight, res_out, hidden, eps, numel, chunk, go, pid, G,
                SIZE, OP, TWO_SHOT, BLOCK, TRAP, BF16_BITS, EPILOGUE, ROW, PHASES,
            )  # fmt: skip
            status = tl.where(waited, status, ssl.WAIT_FAILED)
    if not go:
        K._poison(out, res_out, numel, chunk, pid, G, SIZE, OP, BF16_BITS, BLOCK, EPILOGUE)
    ssl.end_call(calls, me, n, OP, status, who, SIZE, True)


assert stalling_kernel.arg_names == K.collective_kernel.arg_names, "the variant must take the shipped signature"
