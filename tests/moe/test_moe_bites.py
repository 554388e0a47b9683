"""The dispatcher's synchronization bites: each step taken out in the rank processes, the oracle fails.

Each test runs the same scenario twice on 2 ranks: with the shipped protocol (the oracle
holds) and with one step of :mod:`symmsync.moe.protocol` replaced by a variant built here (the
oracle fails). The kernels call the protocol through the module's attributes, which Triton's
interpreter resolves when a kernel runs, so a variant put in the module's place before a
call is what the kernels run; every rank puts the shipped functions back before it returns
(the ranks are the ``host_ranks`` pool's). One rank is late (a host sleep before its call, or a
spin inside its launches after their waits), so that the race the step closes is real.

* the dispatch's receive wait (``check`` neither waiting nor checking in a dispatch's
  receive): the receiver returns its rows before a slow sender's rows land;
* the dispatch's counts wait (the same in a dispatch's send): a sender stores its rows before
  a late member's counts land, at offsets that are not the rows' packed places;
* the combine's wait (the same in a combine's reduce): a member sums before a late expert
  owner's outputs land;
* the parity (``parity`` always 0): back-to-back dispatches with a slow reader, whose counts
  the next dispatch of the other member overwrites while it reads them;
* the header check (``check`` that waits but never compares the members' step headers): one
  member dispatches while the other combines, and a member takes a step the other never made
  for its own instead of raising :class:`~symmsync.moe.StepMismatch` on both.
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
READ_LAG_NS = 0  # set per process: the slow member's spin after its waits


SHIPPED_CHECK = protocol.check  # what the variants wrap (the module's attribute is replaced)


@triton.jit
def _ok(calls):
    n = ssl.call_number(calls)
    return n, n * 0 + ssl.CALL_OK, n * 0 - 1


@triton.jit
def no_receive_wait(calls, sig, me, timeout_ns, record, state, a, refused, KIND: tl.constexpr, PHASE: tl.constexpr,
                    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``check`` that neither waits nor checks in a dispatch's receive (a slow sender's send else)."""
    if (KIND == 0) and (PHASE == 1):
        return _ok(calls)
    else:
        return slow_sender(calls, sig, me, timeout_ns, record, state, a, refused, KIND, PHASE, SIZE, NSLOTS, TRAP)


@triton.jit
def no_counts_wait(calls, sig, me, timeout_ns, record, state, a, refused, KIND: tl.constexpr, PHASE: tl.constexpr,
                   SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``check`` that neither waits nor checks in a dispatch's send: its rows go before the counts."""
    if (KIND == 0) and (PHASE == 0):
        return _ok(calls)
    else:
        return SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, a, refused, KIND, PHASE, SIZE, NSLOTS, TRAP)


@triton.jit
def no_combine_wait(calls, sig, me, timeout_ns, record, state, a, refused, KIND: tl.constexpr, PHASE: tl.constexpr,
                    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``check`` that neither waits nor checks in a combine's reduce."""
    if KIND == 1:
        return _ok(calls)
    else:
        return SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, a, refused, KIND, PHASE, SIZE, NSLOTS, TRAP)


@triton.jit
def no_header_check(calls, sig, me, timeout_ns, record, state, a, refused, KIND: tl.constexpr, PHASE: tl.constexpr,
                    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``check`` that waits but never compares the members' headers."""
    n = ssl.call_number(calls)
    for m in tl.static_range(SIZE):
        if (m != me) | (tl.full((), PHASE, tl.int32) == 1):
            ssl.wait_signal(sig, me, m, 0, 2 * n + 1 + PHASE, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)
    return _ok(calls)


@triton.jit
def slow_check(calls, sig, me, timeout_ns, record, state, a, refused, KIND: tl.constexpr, PHASE: tl.constexpr,
               SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """The shipped ``check``, then a spin of ``READ_LAG_NS`` before the program goes on (a slow member)."""
    out = SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, a, refused, KIND, PHASE, SIZE, NSLOTS, TRAP)
    spin(READ_LAG_NS)
    return out


@triton.jit
def slow_sender(calls, sig, me, timeout_ns, record, state, a, refused, KIND: tl.constexpr, PHASE: tl.constexpr,
                SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """The shipped ``check``, then, in a dispatch's send, a spin of ``READ_LAG_NS`` before its rows."""
    out = SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, a, refused, KIND, PHASE, SIZE, NSLOTS, TRAP)
    if (KIND == 0) and (PHASE == 0):
        spin(READ_LAG_NS)
    return out


@triton.jit
def no_parity(calls):
    """Every step on parity 0."""
    return ssl.call_number(calls) * 0


VARIANTS = {
    "receive_wait": {"check": no_receive_wait},
    "counts_wait": {"check": no_counts_wait},
    "combine_wait": {"check": no_combine_wait},
    "header_check": {"check": no_header_check},
    "slow_reader": {"check": slow_check},
    "slow_sender": {"check": slow_sender},
    "parity": {"parity": no_parity, "check": slow_check},
}


def replaced(name):
    """The protocol with variant ``name``'s steps in place for the block (none: the shipped one)."""
    return helpers.replaced(protocol, **VARIANTS.get(name, {}))


def scenario(variant, late, layers, with_combine, who=1):
    """Layers on a fresh dispatcher under ``variant``; the oracle's verdict per layer (a list of
    what differed; empty: exact). ``late``: ``"dispatch"``/``"combine"``: rank ``who`` sleeps before
    that call; ``"read"``: its launches spin after their waits (the slow variants')."""
    global READ_LAG_NS
    world, me = dist.get_world_size(), dist.get_rank()
    READ_LAG_NS = LAG_NS if (late == "read" and me == who) else 0
    buf, disp = make(4, 3, 32, torch.bfloat16, 2, timeout_s=60)
    wrong, inputs, outs = [], [], []
    try:
        with replaced(variant):
            for i in range(layers):
                x, ids, w = routings.routing("random", me, world, 4, 3, 32, 2, torch.bfloat16, 100 + i)
                if late == "dispatch" and me == who:
                    time.sleep(LATE_S)
                recv, counts, handle = disp.dispatch(x, ids)
                y = None
                if with_combine:
                    out = experts(disp, recv)
                    if late == "combine" and me == who:
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


def _bites(host_ranks, variant, late, layers=2, with_combine=True, shipped=None, who=1):
    held = host_ranks(scenario, 2, shipped, late, layers, with_combine, who, timeout_s=300)
    assert held == [[], []], f"the shipped protocol must hold here: {held}"
    broken = host_ranks(scenario, 2, variant, late, layers, with_combine, who, timeout_s=300)
    assert any(broken), f"with the {variant} taken out the oracle must fail: {broken}"
    print(f"{variant} taken out: {broken}")  # shown with -s: what the oracle caught
    return broken


def test_the_dispatch_receive_wait_bites(host_ranks):
    # Dispatches only, rank 1 slow between its counts and its rows: without the receive's wait rank
    # 0 returns its rows before rank 1's land (the next step's waits would catch a mismatch instead).
    broken = _bites(host_ranks, "receive_wait", "read", with_combine=False, shipped="slow_sender")
    assert any("received rows" in s for s in broken[0]), broken


def test_the_dispatch_counts_wait_bites(host_ranks):
    # Rank 0 late: rank 1, storing before it has rank 0's counts, puts its rows at offset 0 of
    # each expert, where rank 0's rows land too (rank 0's own offsets are 0: it needs no counts).
    broken = _bites(host_ranks, "counts_wait", "dispatch", with_combine=False, who=0)
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
