"""symmsync.gemm's synchronization bites: each step of its tile protocol taken out in the rank
processes, the oracle fails.

Each test runs one scenario twice on 2 host ranks: with the shipped protocol (the oracle holds)
and with one step of :mod:`symmsync.gemm.kernels` replaced by a variant built here (the oracle
fails). The kernels call the steps through the module's attributes, which Triton's interpreter
resolves when a kernel runs (``helpers.replaced``). One member is late, by a spin inside its
kernel, so that the race each step closes is real:

* the tile wait (``wait_block`` returning at once), all-gather: member 1 spins after its header's
  release and before its rows, and member 0 reads member 1's block before it lands;
* the same for the reduce-scatter's partial sums;
* the parity (every call on copy 0): member 0 spins after its verdict, before it reads, while
  member 1 finishes the call and stores its next call's rows over the copy member 0 reads;
* the header check (``verdict`` that waits but never compares): members whose rows differ take
  each other's call for their own instead of raising CallMismatch.
"""

import helpers
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from gemm_cases import buffer_bytes, gathered_reference, ints, made, mismatch, scattered_reference
from helpers import spin

import symmsync as ss
import symmsync.language as ssl
from symmsync.gemm import kernels

LAG_NS = 1_000_000_000
START_LAG_NS = 0  # set per process: the late sender's spin after its header's release
READ_LAG_NS = 0  # set per process: the slow reader's spin after its verdict

SHIPPED_START = kernels.start
SHIPPED_VERDICT = kernels.verdict


@triton.jit
def no_wait(sig, me, s, block, c, timeout_ns, record, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):
    """``wait_block`` that does not wait."""
    return tl.full((), 0, tl.int32)


@triton.jit
def late_start(calls, sig, me, c, KIND: tl.constexpr, m, refused, SIZE: tl.constexpr, NSLOTS: tl.constexpr):
    """The shipped ``start``, then a spin of ``START_LAG_NS`` before the member's rows go out."""
    SHIPPED_START(calls, sig, me, c, KIND, m, refused, SIZE, NSLOTS)
    spin(START_LAG_NS)


@triton.jit
def slow_verdict(calls, sig, me, c, KIND: tl.constexpr, m, refused, timeout_ns, record,
                 SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """The shipped ``verdict``, then a spin of ``READ_LAG_NS`` before the member reads."""
    out = SHIPPED_VERDICT(calls, sig, me, c, KIND, m, refused, timeout_ns, record, SIZE, NSLOTS, TRAP)
    spin(READ_LAG_NS)
    return out


@triton.jit
def no_parity(c):
    """Every call on copy 0."""
    return c * 0


@triton.jit
def no_header_check(calls, sig, me, c, KIND: tl.constexpr, m, refused, timeout_ns, record,
                    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``verdict`` that waits for every header's release but never compares the headers."""
    failed = tl.full((), 0, tl.int32)
    for p in tl.static_range(SIZE):
        if p != me:
            failed += ssl.wait_signal(sig, me, p, 0, c + 1, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)
    return c * 0 + ssl.CALL_OK, c * 0 - 1, failed


VARIANTS = {
    "late": {"start": late_start},
    "wait": {"start": late_start, "wait_block": no_wait},
    "slow": {"verdict": slow_verdict},
    "parity": {"verdict": slow_verdict, "parity": no_parity},
    "header_check": {"verdict": no_header_check},
}


def scenario(variant, which, calls):
    """``calls`` calls of consumer ``which`` ("ag" or "rs") under ``variant``; what differed from
    the oracle, per call (empty: exact)."""
    global START_LAG_NS, READ_LAG_NS
    w, me = dist.get_world_size(), dist.get_rank()
    START_LAG_NS = LAG_NS if (variant in ("late", "wait") and me == 1) else 0
    READ_LAG_NS = LAG_NS if (variant in ("slow", "parity") and me == 0) else 0
    m, k, n = 16, 32, 16
    wrong = []
    try:
        with ss.SymmetricBuffer(buffer_bytes(w, 16, k, n, torch.float32), backend="host") as buf:
            ag, rs = made(buf, 16, k, n, torch.float32, timeout_s=60)
            with ag, rs, helpers.replaced(kernels, **VARIANTS[variant]):
                for call in range(calls):
                    bs = [ints((k, n), 100 * call + 50 + p, torch.float32) for p in range(w)]
                    if which == "ag":
                        rows = [ints((m, k), 100 * call + p, torch.float32) for p in range(w)]
                        good = torch.equal(ag(rows[me], bs[me]), gathered_reference(rows, bs[me]))
                    else:
                        rows = [ints((w * m, k), 100 * call + p, torch.float32) for p in range(w)]
                        good = torch.equal(rs(rows[me], bs[me]), scattered_reference(rows, bs, me, m))
                    if not good:
                        wrong.append(f"call {call}: {which} differs from the oracle")
    finally:
        START_LAG_NS = READ_LAG_NS = 0
    return wrong


def _bites(host_ranks, shipped, variant, which, calls=1):
    held = host_ranks(scenario, 2, shipped, which, calls, timeout_s=300)
    assert held == [[], []], f"the shipped protocol must hold here: {held}"
    broken = host_ranks(scenario, 2, variant, which, calls, timeout_s=300)
    assert broken[0], f"with the {variant} taken out member 0's oracle must fail: {broken}"
    print(f"{variant} taken out: {broken}")  # shown with -s: what the oracle caught


def test_the_all_gather_tile_wait_bites(host_ranks):
    _bites(host_ranks, "late", "wait", "ag")


def test_the_reduce_scatter_tile_wait_bites(host_ranks):
    _bites(host_ranks, "late", "wait", "rs")


def test_the_parity_bites(host_ranks):
    _bites(host_ranks, "slow", "parity", "ag", calls=2)


def _mismatch_under(variant):
    with helpers.replaced(kernels, **VARIANTS[variant]):
        return mismatch("host")


def test_the_header_check_bites(host_ranks):
    assert host_ranks(mismatch, 2, "host", timeout_s=300) == [("CallMismatch", "CallMismatch")] * 2
    broken = host_ranks(_mismatch_under, 2, "header_check", timeout_s=300)
    assert not any(first == "CallMismatch" for first, _ in broken), (
        f"with the header check taken out, members whose rows differ must take the call for a good one: {broken}"
    )
