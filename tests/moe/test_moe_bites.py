"""The dispatcher's synchronization bites: each step taken out in the rank processes, the oracle fails.

Each test runs the same scenario twice on 2 ranks: with the shipped protocol (the oracle
holds) and with one step of :mod:`symmsync.moe.protocol` replaced by a variant built here (the
oracle fails). The kernels call the protocol through the module's attributes, which Triton's
interpreter resolves when a kernel runs, so a variant put in the module's place before a
call is what the kernels run; every rank puts the shipped functions back before it returns
(the ranks are the ``host_ranks`` pool's). One rank is late (a host sleep before its call, or a
spin inside its read launch), so that the race the step closes is real.

* the dispatch's wait (``notify_and_wait`` without its counted waits on the dispatch slot): the
  receiver reads its region before a late sender's rows land;
* the combine's wait (the same, on the combine slot): a member sums before a late expert
  owner's outputs land;
* the parity (``parity`` and ``finished_parity`` always 0): back-to-back dispatches with a slow
  reader, whose region the next dispatch of the other member overwrites while it reads.
"""

import contextlib
import time

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


@triton.jit
def _notify(sig, me, timeout_ns, record, state, KIND: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr,
            TRAP: tl.constexpr, SKIP: tl.constexpr):  # fmt: skip
    tl.debug_barrier()
    for m in tl.static_range(SIZE):
        ssl.signal(sig, me, m, KIND, 1, ssl.ADD, NSLOTS)
    failed = me * 0
    if KIND != SKIP:
        for m in tl.static_range(SIZE):
            failed += ssl.wait_count(sig, me, m, KIND, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
    tl.store(state + 2 * KIND + 1, failed.to(tl.int64))
    tl.store(state + 2 * KIND, tl.load(state + 2 * KIND) + 1)


@triton.jit
def no_dispatch_wait(sig, me, timeout_ns, record, state, KIND: tl.constexpr, SIZE: tl.constexpr,
                     NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``notify_and_wait`` that signals but does not wait on the dispatch slot."""
    _notify(sig, me, timeout_ns, record, state, KIND, SIZE, NSLOTS, TRAP, 0)


@triton.jit
def no_combine_wait(sig, me, timeout_ns, record, state, KIND: tl.constexpr, SIZE: tl.constexpr,
                    NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """``notify_and_wait`` that signals but does not wait on the combine slot."""
    _notify(sig, me, timeout_ns, record, state, KIND, SIZE, NSLOTS, TRAP, 1)


@triton.jit
def slow_finished_parity(state, KIND: tl.constexpr):
    """The shipped ``finished_parity``, after a spin of ``READ_LAG_NS`` (a slow reader)."""
    spin(READ_LAG_NS)
    return (tl.load(state + 2 * KIND) - 1) % 2


@triton.jit
def no_parity(state, KIND: tl.constexpr):
    """Every step on parity 0."""
    return tl.load(state) * 0


@triton.jit
def slow_no_finished_parity(state, KIND: tl.constexpr):
    spin(READ_LAG_NS)
    return tl.load(state) * 0


VARIANTS = {
    "dispatch_wait": {"notify_and_wait": no_dispatch_wait},
    "combine_wait": {"notify_and_wait": no_combine_wait},
    "slow_reader": {"finished_parity": slow_finished_parity},
    "parity": {"parity": no_parity, "finished_parity": slow_no_finished_parity},
}


@contextlib.contextmanager
def replaced(name):
    shipped = {k: getattr(protocol, k) for k in VARIANTS.get(name, {})}
    for k, v in VARIANTS.get(name, {}).items():
        setattr(protocol, k, v)
    try:
        yield
    finally:
        for k, v in shipped.items():
            setattr(protocol, k, v)


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
            if not (oracle.same_bits(recv, rows) and torch.equal(per_source, fill)):
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
    broken = _bites(host_ranks, "dispatch_wait", "dispatch")
    assert any("received rows" in s for r in broken for s in r), broken


def test_the_combine_wait_bites(host_ranks):
    broken = _bites(host_ranks, "combine_wait", "combine")
    assert any("combined output" in s for r in broken for s in r), broken


def test_the_dispatch_parity_bites(host_ranks):
    broken = _bites(host_ranks, "parity", "read", layers=3, with_combine=False, shipped="slow_reader")
    assert any("received rows" in s for s in broken[1]), broken
