"""What a view that spans nodes owns: one node view and one exchange, shared by its consumers,
released with the view. 2 simulated nodes x 2 ranks (``SYMMSYNC_NODE_SIZE=2``), host backend.

* every collective and writer over one spanning view uses the same node view and the same
  exchange; a buffer with room for only those two views takes all of them;
* a job that builds and closes 20 buffers, each with spanning collectives and a writer, keeps
  its count of live torch.distributed groups bounded (none in torch.distributed's table, two
  hand-made gloo groups per live view, none after close), and every call in it is right;
* an abort passes both ways between the view and its node view (one home:
  ``symmsync.spanning.parts``).
"""

import pytest
import torch
import torch.distributed as dist
from oracles import GUARD_BYTES, Cache

import symmsync as ss
from symmsync import collectives as C
from symmsync import pcp
from symmsync.core.nodes import NODE_SIZE_ENV
from symmsync.spanning import exchange

ROUNDS = 20
NUMEL = 64


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(4, {NODE_SIZE_ENV: "2"}, timeout_s=300)


def _consumers(buf, view, cache):
    per = C.workspace_bytes(NUMEL, torch.float32, view.size, "all_reduce", nodes=2)  # the all-reduce's room
    at = -(-(cache.end + GUARD_BYTES) // 128) * 128  # a workspace starts on a 128-byte line
    ar = C.AllReduce(view, NUMEL, torch.float32, offset=at, timeout_s=30)
    ag = C.AllGather(view, NUMEL, torch.float32, offset=at + per, channel=1, timeout_s=30)
    writer = pcp.DirectKVWriter(view, cache.layout, channel=2, timeout_s=30)
    return ar, ag, writer


def shared_parts():
    """Three consumers over one spanning view in a buffer of two views at most."""
    cache = Cache(4, 1, 8, base=GUARD_BYTES)
    buf = ss.SymmetricBuffer(1 << 20, backend="host", max_views=2)
    view = ss.pcp_view(buf)
    ar, ag, writer = _consumers(buf, view, cache)
    same = (
        ar.node_view is ag.node_view is writer.node_view,
        ar.offnode is ag.offnode is writer.offnode,
        list(ar.node_view.ranks),
    )
    x = torch.full((NUMEL,), float(buf.rank + 1))
    sums = ar(x).tolist()
    buf.close()
    return same, sums


def test_the_consumers_of_a_spanning_view_share_its_node_view_and_exchange(pool):
    for rank, ((views, exchanges, members), sums) in enumerate(pool.call(shared_parts)):
        assert views and exchanges, rank
        assert members == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert sums == [10.0] * NUMEL, (rank, sums)


def build_and_close(rounds):
    """``rounds`` times: a buffer, an all-reduce, an all-gather and a writer over its spanning
    view, a call of each collective, close. What torch.distributed's table and symmsync's live
    exchange groups hold after each round's consumers are made and after its close."""
    cache = Cache(4, 1, 8, base=GUARD_BYTES)
    table = len(dist.distributed_c10d._world.pg_map)
    # Counted from what the process holds now: these ranks serve other modules' tests too
    # (tests/conftest.py), and an OffNode dropped before its buffer's close() keeps its groups.
    held = len(exchange.live_groups())
    live, closed, right, tables = [], [], [], []
    for i in range(rounds):
        buf = ss.SymmetricBuffer(1 << 20, backend="host")
        view = ss.pcp_view(buf)
        ar, ag, _writer = _consumers(buf, view, cache)
        x = torch.full((NUMEL,), float(buf.rank + i))
        summed, gathered = ar(x).tolist(), ag(x).view(4, NUMEL).tolist()  # every rank calls both
        right.append(
            summed == [float(sum(r + i for r in range(4)))] * NUMEL
            and gathered == [[float(r + i)] * NUMEL for r in range(4)]
        )
        live.append(len(exchange.live_groups()) - held)
        buf.close()
        closed.append(len(exchange.live_groups()) - held)
        tables.append(len(dist.distributed_c10d._world.pg_map) - table)
    return live, closed, right, tables


def test_building_and_closing_20_spanning_consumers_keeps_the_groups_bounded(pool):
    for rank, (live, closed, right, tables) in enumerate(pool.call(build_and_close, ROUNDS)):
        assert all(right), (rank, right)
        assert live == [2] * ROUNDS, (rank, live)  # the view's one exchange: its group and this position's
        assert closed == [0] * ROUNDS, (rank, closed)
        assert tables == [0] * ROUNDS, (rank, tables)  # nothing entered torch.distributed's table


def abort_one_way(which):
    """Rank 3 aborts the spanning view or its node view; what each rank's views say after it."""
    cache = Cache(4, 1, 8, base=GUARD_BYTES)
    buf = ss.SymmetricBuffer(1 << 20, backend="host")
    view = ss.pcp_view(buf)
    ar, _ag, _writer = _consumers(buf, view, cache)
    if buf.rank == 3:
        (view if which == "view" else ar.node_view).abort("planted: rank 3 gave up")
    dist.barrier()
    states = (view.aborted, ar.node_view.aborted)
    buf.close()
    return states


@pytest.mark.parametrize("which", ["view", "node view"])
def test_an_abort_of_either_view_aborts_the_other_on_that_rank(pool, which):
    for rank, (view, node_view) in enumerate(pool.call(abort_one_way, which)):
        if rank == 3:
            assert view == node_view == "planted: rank 3 gave up", (view, node_view)
        else:
            assert view is None and node_view is None, (rank, view, node_view)
