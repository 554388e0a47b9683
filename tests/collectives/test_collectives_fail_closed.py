"""A collective call is all-or-nothing, and a failed or closed collective fails closed (host backend).

* a call on a closed collective raises ``ClosedError`` on that rank and launches nothing;
* a bad input raises ``InputError`` on the rank that made it, and every peer's matching call
  raises ``PeerRefused`` naming that rank; the next calls of every rank sum, also when that
  rank calls again at once;
* after a failed call (a recorded mismatch or timeout) every later call of every rank raises
  that rank's first failure, the same error object, and launches nothing;
* a peer never returns a result for a call that a member refused, whatever the timing;
* a launch kept past ``close()`` publishes nothing a peer could take for an arrival, writes
  nothing, and fails, also when a stray store left a passing count in its slot;
* where members share one GPU, a ``synchronize()`` whose device never comes back still ends
  with the recorded error (or the stall's).

Each rank returns what it saw (types, messages, whether two errors are one object); the
oracles are the documented errors of docs/collectives.md ("When a call fails").
"""

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
from symmsync import collectives as C
from symmsync.collectives import kernels as K
from symmsync.collectives import operations as ops
from symmsync.core import failure
from symmsync.core.memory import CLOSED_EPOCH
from symmsync.language import cells, records

N = 64
TOO_MANY = "x has 65 elements, more than the 64 torch.float32 elements the workspace holds"


def _setup(timeout_s=60.0, algorithm="one_shot"):
    world = dist.get_world_size()
    buf = ss.SymmetricBuffer(C.workspace_bytes(N, torch.float32, world), backend="host")
    view = buf.view(list(range(world)))
    return buf, view, C.AllReduce(view, N, torch.float32, algorithm, timeout_s=timeout_s)


def _calls(ar, inputs):
    """Call ``ar`` on each input; per call ``("returned", values)`` or ``(type, message, aborted or
    origin)``, and whether every error after the first is the first one (the same object)."""
    seen, errors = [], []
    for x in inputs:
        try:
            seen.append(("returned", ar(x).tolist()))
        except ss.SymmSyncError as e:
            seen.append((type(e).__name__, str(e), getattr(e, "aborted", getattr(e, "origin", None))))
            errors.append(e)
    return {"calls": seen, "same_error": all(e is errors[0] for e in errors)}


def _fence_record(ar):
    return ar.fence._record.tolist()


# ---------------------------------------------------------------------- closed
def closed_collective():
    buf, view, ar = _setup()
    good = ar(torch.ones(8)).tolist()
    dist.barrier()
    buf.close()
    out = _calls(ar, [torch.ones(8), torch.ones(8)])
    try:
        ar.input(8)
        out["input"] = "returned"
    except ss.ClosedError as e:
        out["input"] = str(e)
    out["good"] = good
    out["record"] = _fence_record(ar)  # a launch after close would have written its failed wait here
    return out


def test_a_call_on_a_closed_collective_raises_closed_error_and_launches_nothing(host_ranks):
    for rank, r in enumerate(host_ranks(closed_collective, 2)):
        assert r["good"] == [2.0] * 8, r
        for call in r["calls"]:
            assert call[0] == "ClosedError" and f"rank {rank}: AllReduce: used after its buffer" in call[1], r
        assert f"rank {rank}: AllReduce.input: used after its buffer was closed" in r["input"], r
        assert r["record"] == [0] * len(r["record"]), r


# ---------------------------------------------------------------------- input errors
def bad_input_then_again(bad_ranks):
    buf, view, ar = _setup()
    rank = dist.get_rank()
    first = torch.ones(N + 1) if rank in bad_ranks else torch.ones(8)
    out = _calls(ar, [first, torch.ones(8), torch.ones(8)])
    buf.close()
    return out


def test_an_input_error_fails_that_call_on_both_members_and_the_next_calls_sum(host_ranks):
    """Rank 1 passes too many elements, then calls again at once: the first call raises on both
    (InputError there, PeerRefused naming rank 1 on its peer), never a CollectiveMismatch
    against the second; the next calls of both sum."""
    peer, bad = host_ranks(bad_input_then_again, 2, (1,))
    assert bad["calls"][0][0] == "InputError" and f"rank 1: AllReduce: {TOO_MANY}" in bad["calls"][0][1], bad
    assert peer["calls"][0][0] == "PeerRefused" and peer["calls"][0][2] == 1, peer
    assert "rank 1 refused its call" in peer["calls"][0][1], peer
    for r in (peer, bad):
        assert r["calls"][1:] == [("returned", [2.0] * 8)] * 2, r


def grad_then_no_grad(op):
    """Rank 1 calls with an input that requires grad (grad mode on), through the eager call or
    the op; then both call under no_grad, which an input that requires grad may."""
    buf, view, ar = _setup()
    x = torch.ones(8, requires_grad=dist.get_rank() == 1)
    call = (lambda t: torch.ops.symmsync.all_reduce.default(t, ar.op_handle, "auto")) if op else ar
    out = {}
    try:
        out["grad"] = ("returned", call(x).tolist())
    except ss.SymmSyncError as e:
        out["grad"] = (type(e).__name__, str(e))
    good_buf, good_view, good = _setup()
    with torch.no_grad():
        out["no_grad"] = good(x).tolist()
    buf.close()
    good_buf.close()
    return out


@pytest.mark.parametrize("op", [False, True], ids=["eager", "op"])
def test_an_input_that_requires_grad_under_grad_mode_is_refused_and_its_peer_told(op, host_ranks):
    # No autograd formula: a backward would get no gradient through the call, so it is refused
    # (an input error, before any launch); under no_grad the same tensor is an ordinary input.
    peer, grad = host_ranks(grad_then_no_grad, 2, op)
    assert (
        grad["grad"][0] == "InputError" and "rank 1: AllReduce: x requires grad and grad mode is on" in grad["grad"][1]
    )
    assert "torch.no_grad()" in grad["grad"][1], grad
    assert peer["grad"][0] == "PeerRefused" and "rank 1 refused its call" in peer["grad"][1], peer
    assert peer["no_grad"] == grad["no_grad"] == [2.0] * 8


def test_the_same_bad_input_on_every_rank_fails_that_call_on_every_rank_with_its_own_error(host_ranks):
    for rank, r in enumerate(host_ranks(bad_input_then_again, 2, (0, 1))):
        assert r["calls"][0][0] == "InputError" and f"rank {rank}: AllReduce: {TOO_MANY}" in r["calls"][0][1], r
        assert r["calls"][1:] == [("returned", [2.0] * 8)] * 2, r


def refused_with_delay(bad_rank, delay_s, algorithm):
    buf, view, ar = _setup(timeout_s=10.0, algorithm=algorithm)
    rank = dist.get_rank()
    dist.barrier()
    if rank == bad_rank:
        time.sleep(delay_s)
        x = torch.ones(7, dtype=torch.int32)  # a dtype the collective does not take
    else:
        x = torch.full((8,), 1.0 + rank)
    out = _calls(ar, [x])
    buf.close()
    return out


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_a_peer_never_returns_a_result_for_a_call_a_member_refused_whatever_the_timing(algorithm, host_ranks):
    """The peer's kernel cannot finish without the refusing member's publish, which says the call
    is refused: it raises PeerRefused naming that member, whether the refusal comes before or
    after it launched."""
    rng = random.Random(31)
    for delay_s in (0.0, rng.uniform(0.01, 0.2), 0.5):
        bad = rng.randrange(2)
        results = host_ranks(refused_with_delay, 2, bad, delay_s, algorithm)
        assert results[bad]["calls"][0][0] == "InputError", (delay_s, results)
        peer = results[1 - bad]["calls"][0]
        assert peer[0] == "PeerRefused" and peer[2] == bad, (delay_s, peer)
        assert f"rank {bad} refused its call" in peer[1], (delay_s, peer)


# ---------------------------------------------------------------------- recorded failures
def mismatch_then_again():
    buf, view, ar = _setup()
    rank = dist.get_rank()
    out = _calls(ar, [torch.ones(8 + rank), torch.ones(8), torch.ones(8)])
    buf.close()
    return out


def test_after_a_mismatch_every_members_next_calls_raise_the_same_first_failure(host_ranks):
    for r in host_ranks(mismatch_then_again, 2):
        assert [c[0] for c in r["calls"]] == ["CollectiveMismatch"] * 3, r
        assert r["same_error"], r


def timeout_then_again(budget):
    buf, view, ar = _setup(timeout_s=budget)
    rank = dist.get_rank()
    if rank == 0:
        out = _calls(ar, [torch.ones(8), torch.ones(8), torch.ones(8)])
        dist.barrier()
    else:
        dist.barrier()  # after rank 0 timed out and called twice more
        # Its first call may complete: rank 0 published that call's input before its wait ran
        # out, and a publish cannot be taken back (docs/collectives.md). Its second cannot.
        out = _calls(ar, [torch.ones(8), torch.ones(8)])
        out["calls"] = out["calls"][1:]
    buf.close()
    return out


def test_after_a_timeout_the_rank_raises_it_again_and_its_peer_raises_peer_aborted_naming_it(host_ranks):
    late, other = host_ranks(timeout_then_again, 2, 1.0)
    assert [c[0] for c in late["calls"]] == ["FenceTimeout"] * 3 and late["same_error"], late
    (call,) = other["calls"]
    assert call[0] == "PeerAborted" and list(call[2]) == [0] and "FenceTimeout" in call[2][0], other


# ---------------------------------------------------------------------- a launch that raises
PLANTED = {"rank": -1}
"""The rank whose kernel raises before it does anything (set in each rank process by the test)."""


def _planted_error(me):
    # A plain function: the interpreter runs it as Python, where a device primitive's check would raise.
    if PLANTED["rank"] == dist.get_rank():
        raise ss.DebugCheckError(f"rank {dist.get_rank()}: a check planted in the kernel failed")


@triton.jit
def planted_kernel(
    x, out, count, refused, calls, ptrs, sptrs, cell, me, timeout_ns, record, mism, counter_off, inputs,
    input_stride, symmetric, reduced, residual, weight, res_out, hidden, eps,
    SIZE: tl.constexpr, OP: tl.constexpr, TWO_SHOT: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK: tl.constexpr,
    TRAP: tl.constexpr, BF16_BITS: tl.constexpr, DTYPE_CODE: tl.constexpr, ALGORITHM: tl.constexpr,
    EPILOGUE: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    _planted_error(me)
    K.collective_kernel(
        x, out, count, refused, calls, ptrs, sptrs, cell, me, timeout_ns, record, mism, counter_off, inputs,
        input_stride, symmetric, reduced, residual, weight, res_out, hidden, eps,
        SIZE, OP, TWO_SHOT, SYMMETRIC, BLOCK, TRAP, BF16_BITS, DTYPE_CODE, ALGORITHM, EPILOGUE, ROW,
    )  # fmt: skip


def launch_raises(planted):
    shipped = ops.KERNEL
    ops.KERNEL = planted_kernel  # the documented seam: read when an operation first launches a variant
    PLANTED["rank"] = planted
    try:
        buf, view, ar = _setup(timeout_s=20.0)
        out = _calls(ar, [torch.ones(8), torch.ones(8)])
        try:
            ar(torch.ones(8))
        except ss.DebugCheckError:  # caught by its own name (symmsync.backends.mode)
            out["caught_by_name"] = True
        except ss.SymmSyncError:
            out["caught_by_name"] = False
        buf.close()
    finally:
        ops.KERNEL = shipped
        PLANTED["rank"] = -1
    return out


def test_a_launch_that_raises_fails_the_collective_and_its_peer_raises_peer_aborted_naming_it(host_ranks):
    peer, planted = host_ranks(launch_raises, 2, 1)
    assert [c[0] for c in planted["calls"]] == ["DebugCheckError"] * 2 and planted["same_error"], planted
    assert planted["caught_by_name"] is True, planted
    assert [c[0] for c in peer["calls"]] == ["PeerAborted"] * 2 and peer["same_error"], peer
    assert list(peer["calls"][0][2]) == [1] and "DebugCheckError: rank 1: a check planted" in peer["calls"][0][2][1]


# ---------------------------------------------------------------------- launches kept past close()
KEPT_BUDGET_S = 8.0


def kept_launch_after_close(garbage):
    buf, view, ar = _setup(timeout_s=KEPT_BUDGET_S)
    rank = dist.get_rank()
    out = torch.empty(8)
    ar(torch.ones(8), out)
    bound = next(iter(ar._bound.values()))  # a launch kept past close(), with its packed arguments
    record = ar.fence._record
    cell = view.cell_offset(0)
    result = {}
    if rank == 0:
        cell_words = buf.cell_memory()[cell : cell + cells.SLOTS + 16].view(torch.int64)
        buf.close()
        if garbage:  # a stray store left member 1's slot in this rank's cell past the closed epoch
            cell_words[cells.SLOTS // 8 + 1] = CLOSED_EPOCH + 5
        out.fill_(-1.0)
        t0 = time.monotonic()
        bound(torch.ones(8), out, 8, 0)  # a call through the kept launch: out's -1 must stay
        result["elapsed_s"] = time.monotonic() - t0
        result["out"] = out.tolist()
        result["record"] = records.read_fence_record(record.tolist()) is not None
        dist.barrier()
    else:
        dist.barrier()  # after rank 0's kept launch
        result.update(_calls(ar, [torch.ones(8)]))
        buf.close()
    return result


@pytest.mark.parametrize("garbage", [False, True], ids=["closed", "closed_with_a_passing_slot"])
def test_a_launch_kept_past_close_fails_writes_nothing_and_never_completes_a_peers_wait(garbage, host_ranks):
    closed, peer = host_ranks(kept_launch_after_close, 2, garbage)
    assert closed["out"] == [-1.0] * 8, closed
    assert closed["record"], closed  # its wait failed and said so
    assert closed["elapsed_s"] < KEPT_BUDGET_S / 2, closed  # at its first polls, not after the budget
    (call,) = peer["calls"]
    assert call[0] == "PeerAborted" and call[2] == {0: "closed"}, peer


# ---------------------------------------------------------------------- a device that never comes back
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "nothing_recorded"])
def test_a_synchronize_that_never_returns_on_a_shared_gpu_raises_the_recorded_error_or_says_it_stalled(
    recorded, monkeypatch
):
    """Where members share one GPU, a trap in one context has left another's
    ``torch.cuda.synchronize()`` blocked for good (docs/gpu.md). Stood in for here by a
    ``torch.cuda.synchronize`` that never returns: the wait still ends, with the record's error
    once the record holds one, else with the stall's error after its bound."""
    blocked = threading.Event()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: blocked.wait())
    err = ss.InputError("rank 1: AllReduce: the members' calls differ")
    t0 = time.monotonic()
    reads = []

    def read_error():
        reads.append(time.monotonic() - t0)
        return err if recorded and reads[-1] > 0.05 else None

    stalled = ss.FenceTimeout("stalled", rank=1, epoch=-1, late={}, channel=0)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(
            failure._synchronize(torch.device("cpu"), read_error, failure.Stall(0.5, lambda: stalled))
        ),
        daemon=True,
    )
    waiter.start()
    waiter.join(10.0)  # a wait that blocks with the device fails here instead of hanging the test
    blocked.set()
    assert got == [err if recorded else stalled], (got, "still waiting" if waiter.is_alive() else "")
    assert reads and reads[-1] < (0.4 if recorded else 5.0), reads[-1:]
