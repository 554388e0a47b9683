"""What every member of a view over nodes sees when one member dies, closes or aborts mid-run.

World 4 split into 2 simulated nodes of 2 ranks (``SYMMSYNC_NODE_SIZE=2``), host backend:
ranks 0 and 1 are one node, 2 and 3 the other. Every rank calls an all-reduce over the view of
all 4 in a loop; after a few good calls the rank at position ``p`` (each of 0 to 3; a death
at 1 and 2 with the soaks, ``make test-soak``) dies (``os._exit``), closes its buffer or aborts
the view, while the others wait in their steps: its node peer in the node step (for it), its
position peer between nodes (for it), the fourth between nodes (for its own node peer, which waits in the node step).

Oracles: every other member raises :class:`~symmsync.PeerAborted` whose
:attr:`~symmsync.PeerAborted.aborted` is ``{p: its reason}`` alone (the reason passed to
``abort``, ``"closed"``, or that it died), and whose message names rank ``p`` and that reason,
never the rank that relayed it nor "the exchange broke"; each raises within 1 s of the first
member that raised (wall-clock stamps the ranks report; the budget is 10 s, so a member left
to its budget shows as 10 s), and the first raises well within the budget of the event. A
later call raises again (fails closed). Close and abort run in the session's pool of such ranks
(tests/conftest.py); a rank that dies takes a run of its own.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers import announce, await_announced, describe_error

import symmsync as ss
from symmsync import collectives as C
from symmsync.core.nodes import NODE_SIZE_ENV
from symmsync.testing import Died, run

ENV = {NODE_SIZE_ENV: "2"}
BUDGET_S = 10.0  # each step's budget: a member that is never told shows as this
WITHIN_S = 1.0  # every member raises within this of the first one that raised
NUMEL = 64
GOOD_CALLS = 3
EVENT_KEY = "test/nodes-failures/event"  # where the leaving rank stamps its event (in the job's store)


def reason_of(p):
    return f"planted: rank {p} gives up"


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(4, ENV, timeout_s=240)


def loop_until_one_leaves(p, how, budget):
    """Rank function: all-reduce over the 4 ranks in a loop; after GOOD_CALLS good calls rank
    ``p`` leaves by ``how`` while the others call on. Returns, for the others, the first error
    (described), its wall-clock time and what a next call raised; for ``p``, its event's time."""
    buf = ss.SymmetricBuffer(C.workspace_bytes(NUMEL, torch.float32, 4, "all_reduce", nodes=2), backend="host")
    view = buf.view([0, 1, 2, 3])
    ar = C.AllReduce(view, NUMEL, torch.float32, timeout_s=budget)
    me = buf.rank
    x = torch.full((NUMEL,), float(me + 1))
    for _ in range(GOOD_CALLS):
        assert ar(x).tolist() == [10.0] * NUMEL
    store = dist.distributed_c10d._get_default_store()
    if me == p:
        # The others have entered their loop of calls, whose first waits for p in its steps (a few
        # statements on: whether p's event lands just before or in that wait, they fail the same way).
        await_announced("calls without p", [r for r in range(4) if r != p], budget)
        store.set(EVENT_KEY, repr(time.time()))
        if how == "die":
            os._exit(7)
        if how == "close":
            buf.close()
        else:
            view.abort(reason_of(p))
        dist.barrier()  # the others are done: only the event told them
        buf.close()
        return how
    announce("calls without p")
    start = time.monotonic()
    err = None
    while time.monotonic() - start < 3 * budget:
        try:
            ar(x)
        except ss.SymmSyncError as e:
            err = describe_error(e) if isinstance(e, ss.FenceTimeout) else {"type": type(e).__name__, "msg": str(e)}
            err["at"] = time.time()
            break
    try:
        ar(x)
        again = "no error"
    except ss.SymmSyncError as e:
        again = type(e).__name__
    event = float(store.get(EVENT_KEY).decode())
    if how != "die":
        dist.barrier()
    buf.close()
    return err, again, event


def check(results, p, how):
    """The oracle of one case: ``results`` of the 4 ranks, rank ``p`` left by ``how``."""
    reason = {"close": "closed", "abort": reason_of(p)}.get(how)
    seen = {}
    for rank, got in enumerate(results):  # the figures first, for the log
        if rank != p and got[0] is not None:
            err, _, event = got
            print(f"{how} p={p} rank {rank}: {err['type']} {err.get('aborted')} {err['at'] - event:.2f} s after")
    for rank, got in enumerate(results):
        if rank == p:
            assert got == (Died(p, 7) if how == "die" else how), got
            continue
        err, again, event = got
        assert err is not None, (rank, "no error within 3 budgets")
        seen[rank] = err["at"] - event
        assert err["type"] == "PeerAborted", (rank, err)
        assert set(err["aborted"]) == {p}, (rank, err)  # the origin alone: no relay
        why = err["aborted"][p]
        if how == "die":
            assert "died" in why, (rank, why)
        else:
            assert why == reason, (rank, why)
        assert f"rank {p} " in err["msg"] and (reason or "died") in err["msg"], (rank, err["msg"])
        assert "the exchange broke" not in err["msg"], (rank, err["msg"])
        assert again == "PeerAborted", (rank, again)
    first = min(seen.values())
    assert first < BUDGET_S / 2, seen  # the first to see it did not wait for its budget
    late = {r: round(t - first, 3) for r, t in seen.items() if t - first > WITHIN_S}
    assert not late, (f"seconds after the first ({first:.3f} s after the event)", late, seen)
    return seen


@pytest.mark.parametrize("p", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_close_or_abort_reaches_every_member_within_a_second_naming_the_origin(pool, how, p):
    check(pool.call(loop_until_one_leaves, p, how, BUDGET_S, timeout_s=120), p, how)


@pytest.mark.timeout(300)
# a fresh job each: a leader and a non-leader of different nodes here, the other two with the soaks (CI time)
@pytest.mark.parametrize("p", [0, pytest.param(1, marks=pytest.mark.soak), pytest.param(2, marks=pytest.mark.soak), 3])
def test_a_death_reaches_every_member_within_a_second_naming_the_origin(p):
    results = run(loop_until_one_leaves, 4, p, "die", BUDGET_S, env=ENV, may_die=[p], timeout_s=150)
    check(results, p, "die")
