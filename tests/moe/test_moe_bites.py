"""The dispatcher's synchronization bites: each step taken out in the rank processes, the oracle fails.

Each test runs the same scenario twice on 2 ranks: with the shipped protocol (the oracle
holds) and with one step of :mod:`symmsync.moe.protocol` replaced by a variant built here (the
oracle fails). The kernels call the protocol through the module's attributes, which Triton's
interpreter resolves when a kernel runs, so a variant put in the module's place before a
call is what the kernels run; every rank puts the shipped functions back before it returns
(the ranks are the ``host_ranks`` pool's). One rank is late (a host sleep before its call, or a
spin inside its read launch), so that the race the step closes is real.

* the dispatch's wait (``check`` neither waiting nor checking in a dispatch's read): the
  receiver reads its region before a late sender's rows land;
* the combine's wait (the same in a combine's reduce): a member sums before a late expert
  owner's outputs land;
* the parity (``parity`` always 0): back-to-back dispatches with a slow reader, whose region
  the next dispatch of the other member overwrites while it reads;
* the header check (``check`` that waits but never compares the members' step headers): one
  member dispatches while the other combines, and a member reads a step the other never made
  instead of raising :class:`~symmsync.moe.StepMismatch` on both.
"""

import time

import helpers
import moe_oracle as oracle
import routings
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from helpers import spin
from test_moe import experts, gathered, make

import symmsync.language as ssl
from symmsync.moe import protocol

LATE_S = 0.4
LAG_NS = 400_000_000
READ_LAG_NS = 0  # set per process: the read launch's spin (the slow reader's)


SHIPPED_CHECK = protocol.check  # what the variants wrap (the module's attribute is replaced)


@triton.jit
def _ok(calls):
    n = ssl.call_number(calls)
    return n, n * 0 + ssl.CALL_OK, n * 0 - 1


@triton.jit
def no_dispatch_wait(calls, sig, me, timeout_ns, record, state, KIND: tl.constexpr, SIZE: tl.constexpr,
                     NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``check`` that neither waits nor checks in a dispatch's read."""
    if KIND == 0:
        return _ok(calls)
    else:
        return SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, KIND, SIZE, NSLOTS, TRAP)


@triton.jit
def no_combine_wait(calls, sig, me, timeout_ns, record, state, KIND: tl.constexpr, SIZE: tl.constexpr,
                    NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``check`` that neither waits nor checks in a combine's reduce."""
    if KIND == 1:
        return _ok(calls)
    else:
        return SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, KIND, SIZE, NSLOTS, TRAP)


@triton.jit
def no_header_check(calls, sig, me, timeout_ns, record, state, KIND: tl.constexpr, SIZE: tl.constexpr,
                    NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``check`` that waits but never compares the members' headers."""
    n = ssl.call_number(calls)
    for m in tl.static_range(SIZE):
        ssl.wait_signal(sig, me, m, 0, n + 1, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)
    return _ok(calls)


@triton.jit
def slow_check(calls, sig, me, timeout_ns, record, state, KIND: tl.constexpr, SIZE: tl.constexpr,
               NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """The shipped ``check``, then a spin of ``READ_LAG_NS`` before the program reads (a slow reader)."""
    out = SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, KIND, SIZE, NSLOTS, TRAP)
    spin(READ_LAG_NS)
    return out


@triton.jit
def no_parity(calls):
    """Every step on parity 0."""
    return ssl.call_number(calls) * 0


VARIANTS = {
    "dispatch_wait": {"check": no_dispatch_wait},
    "combine_wait": {"check": no_combine_wait},
    "header_check": {"check": no_header_check},
    "slow_reader": {"check": slow_check},
    "parity": {"parity": no_parity, "check": slow_check},
}


def replaced(name):
    """The protocol with variant ``name``'s steps in place for the block (none: the shipped one)."""
    return helpers.replaced(protocol, **VARIANTS.get(name, {}))


def scenario(variant, late, layers, with_combine):
    """Layers on a fresh dispatcher under ``variant``; the oracle's verdict per layer (a list of
    what differed; empty: exact). ``late``: ``"dispatch"``/``"combine"``: rank 1 sleeps before that
    call; ``"read"``: rank 1's read launches spin."""
    global READ_LAG_NS
    world, me = dist.get_world_size(), dist.get_rank()
    READ_LAG_NS = LAG_NS if (late == "read" and me == 1) else 0
    buf, disp = make(4, 3, 32, torch.bfloat16, 2, timeout_s=60)
    wrong, inputs, outs = [], [], []
    try:
        with replaced(variant):
            for i in range(layers):
                x, ids, w = routings.routing("random", me, world, 4, 3, 32, 2, torch.bfloat16, 100 + i)
                if late == "dispatch" and me == 1:
                    time.sleep(LATE_S)
                recv, counts, handle = disp.dispatch(x, ids)
                y = None
                if with_combine:
                    out = experts(disp, recv)
                    if late == "combine" and me == 1:
                        time.sleep(LATE_S)
                    y = disp.combine(out, w, handle)
                outs.append((recv.clone(), handle.per_source.clone(), y))
                inputs.append((x, ids, w))
        everyone = gathered(inputs)
        for i, (recv, per_source, y) in enumerate(outs):
            xs, ids = [everyone[r][i][0] for r in range(world)], [everyone[r][i][1] for r in range(world)]
            rows, _, fill = oracle.dispatch(xs, ids, 4, 3, me)
            got = oracle.received(recv, fill.sum(1))
            if not (oracle.same_bits(got, rows) and torch.equal(per_source, fill)):
                wrong.append(f"layer {i}: received rows or counts differ")
            if y is not None and not oracle.same_bits(y, oracle.combine(xs[me], ids[me], everyone[me][i][2])):
                wrong.append(f"layer {i}: combined output differs")
    finally:
        READ_LAG_NS = 0
        buf.close()
    return wrong


def _bites(host_ranks, variant, late, layers=2, with_combine=True, shipped=None):
    held = host_ranks(scenario, 2, shipped, late, layers, with_combine, timeout_s=300)
    assert held == [[], []], f"the shipped protocol must hold here: {held}"
    broken = host_ranks(scenario, 2, variant, late, layers, with_combine, timeout_s=300)
    assert any(broken), f"with the {variant} taken out the oracle must fail: {broken}"
    print(f"{variant} taken out: {broken}")  # shown with -s: what the oracle caught
    return broken


def test_the_dispatch_wait_bites(host_ranks):
    # Dispatches only: without its wait a member runs ahead into its next step, whose wait (one
    # count for every step) and header check would then catch it as a mismatch instead.
    broken = _bites(host_ranks, "dispatch_wait", "dispatch", with_combine=False)
    assert any("received rows" in s for r in broken for s in r), broken


def test_the_combine_wait_bites(host_ranks):
    broken = _bites(host_ranks, "combine_wait", "combine", layers=1)  # one step after it: none to catch it
    assert any("combined output" in s for r in broken for s in r), broken


def test_the_dispatch_parity_bites(host_ranks):
    broken = _bites(host_ranks, "parity", "read", layers=3, with_combine=False, shipped="slow_reader")
    assert any("received rows" in s for s in broken[1]), broken


def mismatched_steps(variant):
    """Rank 0 dispatches while rank 1 combines, after one good dispatch and combine; what each
    call raised (``None``: nothing), and whether the dispatcher's next call refuses to run."""
    me = dist.get_rank()
    buf, disp = make(4, 3, 32, torch.bfloat16, 2, timeout_s=60)
    try:
        with replaced(variant):
            x, ids, w = routings.routing("random", me, 2, 4, 3, 32, 2, torch.bfloat16, 7)
            recv, counts, handle = disp.dispatch(x, ids)
            out = experts(disp, recv)
            disp.combine(out, w, handle)
            try:
                if me == 0:
                    disp.dispatch(x, ids)
                else:
                    disp.combine(out, w, handle)
                raised = None
            except Exception as e:  # noqa: BLE001 - what it raised is the verdict
                raised = f"{type(e).__name__}: {e}"
    finally:
        buf.close()
    return raised


def test_the_step_header_check_bites(host_ranks):
    held = host_ranks(mismatched_steps, 2, None, timeout_s=300)
    for rank, raised in enumerate(held):
        assert raised is not None and raised.startswith("StepMismatch"), f"rank {rank}: {raised}"
    assert all("call: rank 0: dispatch, rank 1: combine" in held[r] for r in range(2)), held
    broken = host_ranks(mismatched_steps, 2, "header_check", timeout_s=300)
    assert not all(b and b.startswith("StepMismatch") for b in broken), (
        f"with the header check taken out, a member must take the other's step for its own: {broken}"
    )
