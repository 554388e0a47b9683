"""The off-node exchange (symmsync.spanning.exchange.OffNode) and failures that cross nodes.

World 4 split into 2 simulated nodes of 2 ranks (``SYMMSYNC_NODE_SIZE=2``), host backend,
gloo. The session's pool of such ranks (tests/conftest.py) serves the exchanges and the failures
that leave every process alive (a close, an abort, a rank that never comes); a rank that dies takes
a run of its own.

Oracles: tensors each rank builds from its own rank, compared with the lists written out
by hand; for a failure, the error's type, the ranks it names, and the time it took against
the budget (an abort missed would show as the whole budget, a hang as the pool's timeout).
"""

import gc
import os
import time

import pytest
import torch
from helpers import announce, await_announced, describe_error, wait_until

import symmsync as ss
from symmsync.core.nodes import NODE_SIZE_ENV
from symmsync.spanning.exchange import OffNode
from symmsync.testing import Died, run

ENV = {NODE_SIZE_ENV: "2"}
BUDGET_S = 8.0  # an exchange's budget in the failure tests: a missed abort shows as this
FAST_S = 3.0  # an abort, close or death must reach the other node within this


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(4, ENV, timeout_s=240)


def _mine(rank, dtype=torch.int64):
    return (torch.arange(5) + 100 * rank).to(dtype)


def _lists(ts):
    return [t.tolist() for t in ts]


# ---------------------------------------------------------------------- the exchange
def gathers():
    buf = ss.SymmetricBuffer(4096, backend="host")
    me, out, offs = buf.rank, {}, []  # every OffNode lives until close() releases its groups
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        offs.append(off := OffNode(buf.view(order), timeout_s=60))
        out[f"view {order}"] = _lists(off.all_gather(_mine(me)))
        out[f"position {order}"] = _lists(off.all_gather(_mine(me, torch.float32), among="position"))
    offs.append(uneven := OffNode(buf.view([0, 1, 2] if me < 3 else [3]), timeout_s=60))  # nodes [0, 1] [2], and [3]
    out["uneven"] = _lists(uneven.all_gather(_mine(me)))
    out["uneven position"] = _lists(uneven.all_gather(_mine(me), among="position"))
    buf.close()
    return out


def test_all_gather_returns_every_members_tensor_in_view_order(pool):
    t = [_mine(r).tolist() for r in range(4)]
    f = [_mine(r, torch.float32).tolist() for r in range(4)]
    for rank, out in enumerate(pool.call(gathers)):
        assert out["view [0, 1, 2, 3]"] == t
        assert out["view [3, 2, 1, 0]"] == [t[3], t[2], t[1], t[0]]
        # the members at this rank's position in its node, one per node, in node order
        assert out["position [0, 1, 2, 3]"] == [f[rank % 2], f[rank % 2 + 2]]
        # view [3, 2, 1, 0]: node [3, 2] comes first (view indices 0, 1); rank 3 is at position 0
        assert out["position [3, 2, 1, 0]"] == ([f[3], f[1]] if rank % 2 else [f[2], f[0]])
        if rank < 3:
            assert out["uneven"] == t[:3]
            assert out["uneven position"] == ([t[0], t[2]] if rank != 1 else [t[1]])
        else:
            assert out["uneven"] == out["uneven position"] == [t[3]]


def budgets():
    buf = ss.SymmetricBuffer(4096, backend="host")
    try:
        OffNode(buf.view([0, 1, 2, 3]), timeout_s=30 if buf.rank != 2 else 31)
        return "no error"
    except ss.ConfigError as e:
        return type(e).__name__, str(e)
    finally:
        buf.close()
        # The refused OffNode's gloo groups, which no close() releases, go now on every member at
        # once: a group left to a later garbage collection on one rank stalls it for the group's
        # timeout (seen as a 25 s wait in a later test on these ranks).
        gc.collect()


def test_budgets_that_differ_are_refused_on_every_member(pool):
    got = pool.call(budgets)
    assert len(set(got)) == 1, got
    assert got[0][0] == "ConfigError" and "OffNode: timeout_s differs across ranks" in got[0][1]


def gather_while_capturing():
    """Every rank calls all_gather as if its stream captured a CUDA graph, then once outside."""
    from symmsync import backends

    buf = ss.SymmetricBuffer(4096, backend="host")
    off = OffNode(buf.view([0, 1, 2, 3]), timeout_s=60)
    real = backends.capturing
    backends.capturing = lambda device: True  # what a capturing CUDA stream reports
    try:
        off.all_gather(_mine(buf.rank))
        refused = "no error"
    except ss.SymmSyncError as e:
        refused = type(e).__name__, str(e)
    finally:
        backends.capturing = real
    after = _lists(off.all_gather(_mine(buf.rank)))  # refused before anything was sent: nothing is broken
    buf.close()
    return refused, after


def test_an_exchange_during_cuda_graph_capture_is_refused_and_leaves_the_view_usable(pool):
    for rank, (refused, after) in enumerate(pool.call(gather_while_capturing)):
        assert refused[0] == "CaptureError", refused
        assert refused[1].startswith(
            f"rank {rank}: OffNode.all_gather: called while a CUDA graph was being captured"
        ), refused
        assert after == [_mine(r).tolist() for r in range(4)]


def groups_of_one_offnode():
    """The gloo groups an OffNode makes: torch.distributed's table of groups before and after, the
    names of this process's live OffNode groups while it lives and after close, one exchange."""
    import torch.distributed as dist

    from symmsync.spanning import exchange

    buf = ss.SymmetricBuffer(4096, backend="host")
    table = len(dist.distributed_c10d._world.pg_map)
    before = exchange.live_groups()
    off = OffNode(buf.view([0, 1, 2, 3]), timeout_s=60)
    mine = [g for g in exchange.live_groups() if g not in before]
    out = _lists(off.all_gather(_mine(buf.rank), among="position"))
    buf.close()
    left = [g for g in exchange.live_groups() if g in mine]
    return table, len(dist.distributed_c10d._world.pg_map), mine, out, left


def test_an_offnodes_groups_are_its_own_and_go_with_close(pool):
    # Made by hand over the store: no entry in torch.distributed's table, whose group names a later
    # group of the same ranks would reuse; two per OffNode (the view's, this position's); none after close.
    for rank, (table, after, mine, out, left) in enumerate(pool.call(groups_of_one_offnode)):
        assert after == table, (table, after)
        assert len(mine) == 2 and mine[0].endswith(f"/position {rank % 2}") and mine[1].endswith("/view"), mine
        assert out == [_mine(rank % 2).tolist(), _mine(rank % 2 + 2).tolist()]
        assert left == [], left


def store_unreadable_on_rank_0(budget):
    """Rank 0 cannot read the torch.distributed store (its host went away) while it waits for rank 3,
    which comes late; then ranks 1 to 3 gather again, without rank 0."""
    import symmsync.spanning.exchange as offnode

    buf = ss.SymmetricBuffer(4096, backend="host")
    off = OffNode(buf.view([0, 1, 2, 3]), timeout_s=budget)
    me = buf.rank
    off.all_gather(_mine(me))
    real = offnode.posted_aborts

    def unreadable(view, ranks):
        raise RuntimeError("planted: connection reset by peer")

    if me == 0:
        offnode.posted_aborts = unreadable
    elif me == 3:  # late: until rank 0's wait has read the store, failed and posted that it gave up
        wait_until(lambda: offnode.posted_aborts(off.view, [0]), "rank 0 to post that it gave up", BUDGET_S)
    calls = []
    try:
        for _ in range(1 if me == 0 else 2):
            t0 = time.monotonic()
            try:
                calls.append(_lists(off.all_gather(_mine(me))))
            except ss.SymmSyncError as e:
                calls.append(describe_error(e))
                calls[-1]["elapsed"] = time.monotonic() - t0
    finally:
        offnode.posted_aborts = real
    buf.close()
    return calls


def test_a_store_that_cannot_be_read_fails_that_rank_and_no_member_is_named_dead(pool):
    got = pool.call(store_unreadable_on_rank_0, BUDGET_S)
    (lost,) = got[0]
    assert lost["type"] == "PeerAborted" and lost["rank"] == 0, lost
    assert "the store could not be read (planted: connection reset by peer)" in lost["msg"], lost
    assert lost["aborted"] == {} and "did not answer" not in lost["msg"], lost  # it cannot tell: it does not guess
    assert lost["elapsed"] < FAST_S, lost
    for rank, (first, second) in enumerate(got[1:], 1):
        # Rank 0 sent its part before it gave up: the others' exchange may still complete, and is
        # then right; or it fails, naming rank 0 and what it posted. Never a member named dead.
        if isinstance(first, list):
            assert first == [_mine(r).tolist() for r in range(4)], (rank, first)
        for err in [e for e in (first, second) if isinstance(e, dict)]:
            assert err["type"] == "PeerAborted" and err["rank"] == rank, (rank, err)
            assert "the store could not be read" in err["aborted"].get(0, ""), (rank, err)
            assert "did not answer" not in err["msg"], (rank, err)
            assert err["elapsed"] < FAST_S, (rank, err)
        assert isinstance(second, dict), (rank, second)  # without rank 0: it fails closed, within a poll and a grace


# ---------------------------------------------------------------------- failures reach the other node
def _gather_once_then(leaver, how, budget):
    """Every rank gathers once; then ``leaver`` leaves the view by ``how`` while the others gather again."""
    buf = ss.SymmetricBuffer(4096, backend="host")
    view = buf.view([0, 1, 2, 3])
    off = OffNode(view, timeout_s=budget)
    me = buf.rank
    off.all_gather(_mine(me))
    if me == leaver:
        # The others have called their second gather (a few statements before its wait; whether the
        # leaver's step lands just before or in their wait, they fail the same way).
        await_announced("second gather", [r for r in range(4) if r != leaver], BUDGET_S)
        if how == "close":
            buf.close()
        elif how == "abort":
            view.abort("planted: gave up")
        elif how == "die":
            os._exit(7)
        else:  # "never": stay away until the others' budget is long gone
            time.sleep(budget + 1)
        buf.close()
        return how
    announce("second gather")
    t0 = time.monotonic()
    try:
        off.all_gather(_mine(me))
        return "no error"
    except ss.FenceTimeout as e:
        first = describe_error(e)
        first["elapsed"] = time.monotonic() - t0
    try:  # fails closed: the same error again, at once
        off.all_gather(_mine(me))
        again = "no error"
    except ss.FenceTimeout as e:
        again = type(e).__name__
    buf.close()
    return first, again


@pytest.mark.parametrize("how, reason", [("close", "closed"), ("abort", "planted: gave up")])
def test_a_rank_that_closes_or_aborts_reaches_the_other_node_as_peer_aborted(pool, how, reason):
    for rank, got in enumerate(pool.call(_gather_once_then, 0, how, BUDGET_S)):
        if rank == 0:
            assert got == how
            continue
        err, again = got
        assert err["type"] == "PeerAborted" and err["rank"] == rank, err
        assert err["aborted"].get(0) == reason, err  # names rank 0 and its reason, whoever read it first
        assert err["elapsed"] < FAST_S, err
        assert again == "PeerAborted"


def test_a_rank_that_never_comes_fails_the_others_at_their_budget(pool):
    budget = 2.0
    for rank, got in enumerate(pool.call(_gather_once_then, 0, "never", budget)):
        if rank == 0:
            assert got == "never"
            continue
        err, again = got
        # the first to time out tells the others, so a rank sees the timeout or that abort
        assert err["type"] in ("FenceTimeout", "PeerAborted"), err
        if err["type"] == "FenceTimeout":
            assert 0 in err["late"] and f"did not finish within its budget of {budget:g} s" in err["msg"]
            assert budget <= err["elapsed"] < budget + FAST_S, err
        else:
            assert 0 not in err["aborted"] and all("timed out" in why for why in err["aborted"].values()), err
        assert again in ("FenceTimeout", "PeerAborted")


@pytest.mark.timeout(300)
def test_a_rank_that_dies_reaches_the_other_node_as_peer_aborted_naming_it():
    results = run(_gather_once_then, 4, 0, "die", BUDGET_S, env=ENV, may_die=[0], timeout_s=240)
    assert results[0] == Died(0, 7)
    for err, again in results[1:]:
        # The dead rank is named as one that did not answer; a live member slower than SILENT_S under
        # load may be named with it, in the same words (gloo does not say who went), never as the origin.
        assert err["type"] == "PeerAborted" and 0 in err["aborted"], err
        assert all(why.startswith("did not answer within") for why in err["aborted"].values()), err
        assert "did not answer within" in err["msg"] and "it died or left" in err["msg"], err
        assert err["elapsed"] < FAST_S, err
        assert again == "PeerAborted"
