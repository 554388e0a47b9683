"""Failures reach every member at once on 2 GPUs : eager and in CUDA-graph replay.

A rank that aborts (or closes its buffer) while its peer's fence kernel waits: the
peer's kernel sees the abort flag within a poll, copies the aborting rank's reason into
the pinned record, traps, and ``Fence.synchronize()`` raises ``PeerAborted`` naming the
rank and the reason, within about a second of the abort, not after the 60 s budget.

Marker ``gpu``: skipped where fewer than 2 GPUs exist. A trapped kernel leaves its CUDA
context unusable, so these runs keep their collectives on gloo.
"""

import time

import helpers
import pytest
import torch.distributed as dist

import symmsync as ss
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2
BUDGET_S = 60.0  # the fence budget: a missed abort shows up as a minute
FAST_S = 2.0  # from the abort call on one rank to the error on the other (typically milliseconds)
WARM = 5  # fences before the abort (every kernel compiled, both ranks in step)


def _setup():
    buf = ss.SymmetricBuffer(1 << 16, backend="cuda")
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=BUDGET_S)
    return buf, view, fence


def _describe(err, t0):
    """The error's fields (helpers.describe_error), when it was raised, and how long after ``t0``."""
    return {**helpers.describe_error(err), "raised_at": time.time(), "elapsed": time.monotonic() - t0}


def _abort_later(buf, fence, how, reason):
    """The aborting rank: once the peer has published its next fence (it is in its wait for this
    rank), abort (or close)."""
    nxt = fence.epoch + 1  # the ranks are in step: the peer's next fence publishes this epoch
    helpers.wait_until(lambda: helpers.published(buf, fence, 0) >= nxt, f"rank 0 to publish fence {nxt}")
    aborted_at = time.time()
    if how == "close":
        buf.close()
        return {"aborted_at": aborted_at}
    fence.abort(reason)
    out = {"aborted_at": aborted_at}
    try:
        fence.fence()  # its own fences on the view fail closed, at once
        out["own"] = "no error"
    except ss.PeerAborted as err:
        out["own"] = err.aborted
    return out


def eager_abort(how, reason):
    buf, view, fence = _setup()
    for _ in range(WARM):
        fence.fence()
    fence.synchronize()
    dist.barrier()
    if buf.rank == 1:
        out = _abort_later(buf, fence, how, reason)
        dist.barrier()  # until the peer has its error
        buf.close()
        return out
    return _wait_for_abort(buf, fence, fence.fence)


def _wait_for_abort(buf, fence, step):
    """The waiting rank: ``step`` fences on the view; describe the error it raises."""
    t0 = time.monotonic()
    try:
        step()
        fence.synchronize()  # the trap surfaces here
        out = "no error"
    except ss.FenceTimeout as err:
        out = _describe(err, t0)
    dist.barrier()
    buf.close()
    return out


def _check(results, reason, epoch):
    a, r = results[1], results[0]
    assert isinstance(r, dict), r
    assert r["type"] == "PeerAborted", r
    assert r["raised_at"] - a["aborted_at"] < FAST_S, (r["raised_at"] - a["aborted_at"], r)
    assert r["elapsed"] < BUDGET_S / 4, r
    assert r["rank"] == 0 and r["epoch"] == epoch and r["late"] == {}, r
    assert r["aborted"] == {1: reason}, r
    return a, r


@pytest.mark.traps
@pytest.mark.parametrize("how", ["abort", "close"])
def test_an_abort_makes_the_waiting_gpu_peer_raise_naming_the_rank_and_reason_at_once(how):
    reason = "bad input: kv_c has 3 rows" if how == "abort" else "closed"
    results = run(eager_abort, WORLD, how, reason, backend="cuda", dist_backend="gloo", timeout_s=240)
    a, r = _check(results, reason, WARM + 1)
    if how == "abort":
        assert a["own"] == {1: reason}, a
        assert f"rank 1 aborted (its slot holds epoch {WARM}): {reason}" in r["msg"], r["msg"]
    else:
        assert r["closed"] == [1] and "rank 1 closed its buffer" in r["msg"], r


def graph_abort(replays, reason):
    buf, view, fence = _setup()
    g = helpers.capture(fence.fence)  # 3 eager warm-up fences, then the capture
    for _ in range(replays):
        g.replay()
    fence.synchronize()
    dist.barrier()
    if buf.rank == 1:
        out = _abort_later(buf, fence, "abort", reason)
        dist.barrier()
        buf.close()
        return out
    return _wait_for_abort(buf, fence, g.replay)  # the captured fence waits for rank 1's next epoch


@pytest.mark.traps
def test_an_abort_reaches_a_peer_replaying_a_cuda_graph_at_once():
    replays, reason = 50, "planted failure during graph replay"
    results = run(graph_abort, WORLD, replays, reason, backend="cuda", dist_backend="gloo", timeout_s=240)
    _check(results, reason, 3 + replays + 1)  # 3 eager warm-up fences, then the replays, then one more
