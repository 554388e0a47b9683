"""Nodes: the layout, its agreement, what a multi-node buffer maps and what it refuses.

World 4 split into 2 simulated nodes of 2 ranks (``SYMMSYNC_NODE_SIZE=2``: node of world
rank w = w // 2), on the host backend, in the session's pool of such ranks (tests/conftest.py).

Oracles: the layouts written out by hand; the process's own mapping table
(``/proc/self/maps``: the shared-memory segments mapped here, named for the rank that
made them) for what each rank maps; bytes written by one rank and read back by its
node peer after a fence; the error type and message on every rank for each refusal.
"""

import gc
import os
import re

import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync.core.nodes import NODE_SIZE_ENV, NodeKey, NodeLayout, partition
from symmsync.tools.runtime_alloc import HostCacheAllocator

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm and /proc/self/maps")

KIB = 1024
TWO_NODES = "2 nodes: [0, 1] [2, 3]"


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(4, {NODE_SIZE_ENV: "2"}, timeout_s=240)


# ---------------------------------------------------------------------- the layout itself
@pytest.mark.timeout(30)
def test_a_layout_answers_who_is_where():
    two = NodeLayout(((0, 1), (2, 3)))
    assert str(two) == TWO_NODES and two.num_nodes == 2 and not two.single and two.uniform
    assert [two.node_of(i) for i in range(4)] == [0, 0, 1, 1]
    assert two.same_node(2, 3) and not two.same_node(1, 2)
    assert two.members_of(3) == (2, 3) and [two.position(i) for i in range(4)] == [0, 1, 0, 1]
    assert two.peers_at(0) == (0, 2) and two.peers_at(1) == (1, 3)
    uneven = NodeLayout(((0, 2, 3), (1,)))
    assert not uneven.uniform and uneven.members_of(1) == (1,) and str(uneven) == "2 nodes: [0, 2, 3] [1]"
    with pytest.raises(ss.ConfigError, match="differ in size"):
        uneven.peers_at(0)
    assert NodeLayout.one(3).single and str(NodeLayout.one(3)) == "1 node: [0, 1, 2]"
    for bad in (((1, 0),), ((0,), (0, 1)), ((2, 3), (0, 1)), ((0, 2),)):
        with pytest.raises(ss.ConfigError, match="each index 0..n-1 once"):
            NodeLayout(bad)


@pytest.mark.timeout(30)
def test_restrict_gives_a_subgroup_its_own_indices():
    two = NodeLayout(((0, 1), (2, 3)))
    assert two.restrict([3, 2, 1, 0]).nodes == ((0, 1), (2, 3))  # ranks 3, 2 are view indices 0, 1
    assert two.restrict([1, 2]).nodes == ((0,), (1,))
    assert two.restrict([2, 0, 3]).nodes == ((0, 2), (1,))  # members 2, 3 at view indices 0, 2
    assert two.restrict([3, 2]).single
    with pytest.raises(ss.ConfigError, match="not a member"):
        two.restrict([0, 4])


@pytest.mark.timeout(30)
def test_ranks_of_one_host_whose_gpus_cannot_map_each_other_are_refused():
    both = ("g0", "g1")
    keys = [NodeKey("a", "g0", both, both), NodeKey("a", "g1", both, both), NodeKey("b", "g2", ("g2",), ("g2",))]
    assert partition(keys, "call").nodes == ((0, 1), (2,))
    # one GPU visible per process: the other cannot be asked about, and the host stays one node
    alone = [NodeKey("a", "g0", ("g0",), ("g0",)), NodeKey("a", "g1", ("g1",), ("g1",))]
    assert partition(alone, "call").single
    split = [NodeKey("a", "g0", both, ("g0",)), NodeKey("a", "g1", both, ("g1",))]
    with pytest.raises(ss.ConfigError, match=r"call: ranks 0 and 1 run on one host \(a\) but .* cannot map"):
        partition(split, "call")


# ---------------------------------------------------------------------- agreement
def layouts():
    buf = ss.SymmetricBuffer(4 * KIB, backend="host")
    me = buf.rank
    world = buf.view([0, 1, 2, 3])
    backwards = buf.view([3, 2, 1, 0])
    node = buf.view(list(buf.nodes.members_of(me)))
    out = str(buf.nodes), str(world.nodes), backwards.nodes.nodes, node.nodes.single, node.ranks
    buf.close()
    return out


def test_every_rank_agrees_on_the_simulated_nodes_and_views_report_theirs(pool):
    for rank, (nodes, world, backwards, single, node) in enumerate(pool.call(layouts)):
        assert nodes == world == TWO_NODES
        assert backwards == ((0, 1), (2, 3))  # world ranks 3, 2 (view indices 0, 1) share node 1
        assert single and node == ((0, 1) if rank < 2 else (2, 3))


def with_setting(values):
    """A buffer made with ``values[rank]`` as this rank's SYMMSYNC_NODE_SIZE (None: unset)."""
    before = os.environ.get(NODE_SIZE_ENV)
    value = values[dist.get_rank()]
    try:
        if value is None:
            os.environ.pop(NODE_SIZE_ENV, None)
        else:
            os.environ[NODE_SIZE_ENV] = value
        buf = ss.SymmetricBuffer(4 * KIB, backend="host")
        out = str(buf.nodes)
        buf.close()
        return out
    except ss.ConfigError as e:
        return type(e).__name__, str(e)
    finally:
        os.environ[NODE_SIZE_ENV] = before


@pytest.mark.parametrize(
    "values, expected",
    [
        ([None] * 4, "1 node: [0, 1, 2, 3]"),  # one host: one node
        (["1"] * 4, "4 nodes: [0] [1] [2] [3]"),
        (["2", "2", "2", "1"], r"SymmetricBuffer: node_size differs across ranks .*'2'.*'1'.*set SYMMSYNC_NODE_SIZE"),
        (
            ["3"] * 4,
            r"SymmetricBuffer: rank 0 \(and ranks 1, 2, 3\): SYMMSYNC_NODE_SIZE='3' must be a positive divisor",
        ),
        (["2", "two", "2", "2"], r"SymmetricBuffer: rank 1: SYMMSYNC_NODE_SIZE='two' must be a positive int"),
    ],
    ids=["unset", "one-each", "differs", "not-a-divisor", "not-an-int"],
)
def test_the_node_setting_is_agreed_or_refused_on_every_rank(pool, values, expected):
    got = pool.call(with_setting, values)
    if not expected.startswith("SymmetricBuffer"):
        assert got == [expected] * 4
        return
    assert len(set(got)) == 1 and isinstance(got[0], tuple), got  # the same error on every rank
    kind, msg = got[0]
    assert kind == "ConfigError" and re.search(expected, msg), msg


# ---------------------------------------------------------------------- what is mapped
def _owners_mapped(prefix: str) -> set[int]:
    """The ranks whose shared-memory segments this process maps, from /proc/self/maps:
    symmsync names each segment ``<prefix>-<owner rank>-<hex>`` (the test's runtime memory
    ``<prefix>-rt<rank>-...``); a mapping outlives the name, so gone names end "(deleted)".
    Collects garbage first: what a closed buffer's objects held goes with them."""
    gc.collect()
    pattern = re.compile(rf"/dev/shm/{re.escape(prefix)}-(?:rt)?(\d+)-")
    with open("/proc/self/maps") as f:
        return {int(m.group(1)) for line in f if (m := pattern.search(line))}


def mapped_owners():
    prefix = os.environ["SYMMSYNC_SHM_PREFIX"]
    me, out = dist.get_rank(), {"before": _owners_mapped(prefix)}
    buf = ss.SymmetricBuffer(8 * KIB, backend="host")
    out["allocated"] = _owners_mapped(prefix)
    buf.close()
    del buf
    grown = ss.SymmetricBuffer(8 * KIB, backend="host", max_nbytes=256 * KIB)
    grown.grow(200 * KIB)
    out["growable"] = _owners_mapped(prefix)
    node = grown.view(list(grown.nodes.members_of(me)))
    fence = ss.Fence(node, timeout_s=60)
    peer = node.ranks[1 - node.local_index]
    grown.tensor(150 * KIB, (4,), torch.int32, rank=peer).fill_(100 + me)  # into memory the grow mapped
    fence.fence()
    out["grown bytes"] = grown.tensor(150 * KIB, (4,), torch.int32).tolist()
    grown.close()
    rt = HostCacheAllocator(512 * KIB, chunk=64 * KIB, tag=f"rt{me}")
    rt.commit(1)
    reg = ss.SymmetricBuffer.register(rt.base, 64 * KIB, max_nbytes=512 * KIB, device="cpu")
    rt.commit(2)
    reg.grow(192 * KIB)
    out["registered"] = _owners_mapped(prefix)
    fence = ss.Fence(reg.view(list(reg.nodes.members_of(me))), timeout_s=60)
    reg.tensor(160 * KIB, (4,), torch.int32, rank=peer).fill_(200 + me)
    fence.fence()
    out["registered bytes"] = rt.tensor(160 * KIB, 4, torch.int32).tolist()  # the runtime reads its own
    reg.close()
    dist.barrier()  # every rank closed before any runtime frees
    rt.free()
    del grown, node, fence, reg  # a fence kept past close holds the mappings it names, by design
    out["after"] = _owners_mapped(prefix)
    return out


def test_a_multi_node_buffer_maps_only_its_node_peers(pool):
    for rank, out in enumerate(pool.call(mapped_owners)):
        node = {0, 1} if rank < 2 else {2, 3}
        peer = rank ^ 1
        assert out["allocated"] == node and out["growable"] == node and out["registered"] == node, out
        assert out["grown bytes"] == [100 + peer] * 4 and out["registered bytes"] == [200 + peer] * 4
        assert out["before"] == out["after"] == set()


# ---------------------------------------------------------------------- refusals
def _error(fn):
    try:
        fn()
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e)
    return "no error"


def refusals():
    buf = ss.SymmetricBuffer(4 * KIB, backend="host")
    me = buf.rank
    far = (me + 2) % 4  # the same position on the other node
    spanning = buf.view([0, 1, 2, 3])
    node = buf.view(list(buf.nodes.members_of(me)))
    out = {
        "tensor": _error(lambda: buf.tensor(0, (4,), torch.int32, rank=far)),
        "view tensor": _error(lambda: spanning.tensor(0, (4,), torch.int32, index=far)),
        "ptrs": _error(lambda: buf.ptrs),
        "cell_ptrs": _error(lambda: buf.cell_ptrs),
        "view ptrs": _error(lambda: spanning.ptrs),
        "view cell_ptrs": _error(lambda: spanning.cell_ptrs),
        "fence": _error(lambda: ss.Fence(spanning)),
        "signals": _error(lambda: ss.Signals(spanning)),
        "node tables": (len(node.ptrs.tolist()), len(node.cell_ptrs.tolist()), all(node.ptrs.tolist())),
        "own and near tensors": _error(
            lambda: (buf.tensor(0, 4, torch.int32), buf.tensor(0, 4, torch.int32, rank=me ^ 1))
        ),
    }
    buf.close()
    ptrs = [0x1000 * (r + 1) for r in range(4)]
    out["adopt"] = _error(lambda: ss.SymmetricBuffer.from_peer_addresses(ptrs, 4 * KIB, device="cpu"))
    return out


def test_what_crosses_nodes_is_refused_on_every_rank(pool):
    for rank, out in enumerate(pool.call(refusals)):
        far, node = (rank + 2) % 4, rank // 2
        assert out["tensor"] == (
            "ViewError",
            f"rank {rank}: SymmetricBuffer.tensor: rank {far} is on node {1 - node} and rank {rank} on node {node} "
            f"({TWO_NODES}); only the peers of one node are mapped: move the data with "
            "symmsync.spanning.exchange.OffNode (or the collectives), or address a rank of your own node",
        )
        assert out["view tensor"][0] == "ViewError" and f"rank {far} is on node {1 - node}" in out["view tensor"][1]
        for what, owner, whose in (
            ("ptrs", "SymmetricBuffer", "the buffer's group"),
            ("cell_ptrs", "SymmetricBuffer", "the buffer's group"),
            ("view ptrs", "PeerView", "the view"),
            ("view cell_ptrs", "PeerView", "the view"),
        ):
            assert isinstance(out[what], tuple) and out[what][0] == "ViewError", out[what]
            msg = out[what][1]
            assert msg.startswith(f"rank {rank}: {owner}.{what.split()[-1]}: {whose} spans {TWO_NODES}"), msg
            assert "kernels take views within one node" in msg and "the collectives and the writer" in msg
        kind, msg = out["fence"]
        assert kind == "ConfigError" and msg.startswith(f"rank {rank}: Fence: the view spans {TWO_NODES}; a Fence")
        kind, msg = out["signals"]  # agreed: every rank raises the first rank's refusal
        assert kind == "ConfigError" and f"Signals: rank 0 (and ranks 1, 2, 3): the view spans {TWO_NODES}" in msg
        assert out["node tables"] == (2, 2, True)  # a node's view works as on one node
        assert out["own and near tensors"] == "no error"
        kind, msg = out["adopt"]
        assert kind == "ConfigError" and "from_peer_addresses: the group spans 2 nodes" in msg, msg


# ---------------------------------------------------------------------- node views work
def node_fences(rounds):
    buf = ss.SymmetricBuffer(4 * KIB, backend="host")
    me = buf.rank
    view = buf.view(list(buf.nodes.members_of(me)))
    fence = ss.Fence(view, timeout_s=60)
    peer = view.ranks[1 - view.local_index]
    seen = []
    for step in range(rounds):
        buf.tensor(0, (8,), torch.int64, rank=peer).fill_(1000 * step + me)  # into the peer's memory
        fence.fence()
        seen.append(buf.tensor(0, (8,), torch.int64).tolist())  # what the peer wrote into mine
        fence.fence()  # nobody writes again before both read
    epoch = fence.epoch
    buf.close()
    return seen, epoch


def test_a_fence_on_a_node_view_of_a_multi_node_buffer_orders_its_members(pool):
    for rank, (seen, epoch) in enumerate(pool.call(node_fences, 3)):
        peer = rank ^ 1
        assert seen == [[1000 * step + peer] * 8 for step in range(3)]
        assert epoch == 6
