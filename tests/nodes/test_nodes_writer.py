"""The PCP writer across nodes: 2 simulated nodes x 2 ranks (``SYMMSYNC_NODE_SIZE=2``), host backend.

One world-4 job checks, for PCP4 = 2 nodes x 2 and TP2 x PCP2 over 2 nodes (rank =
pcp_rank * tp + tp_rank: each PCP group has one member on each node), every cache format on
the direct route (direct within a node, all-gather of the compact KV between nodes) and the
all-gather route: each rank's replica, read as raw bytes right after ``write()`` returns with
one member late (no barrier before the check), equals the cache that plain torch builds from
the whole prompt (all-gather + insert, tests/oracles.py, written from the format rules);
every other byte of the buffer keeps its poison. In the same job: a view within one node
keeps the one-node route; ``route="direct"`` on nodes of different sizes is refused on every
rank; a member that closes on the other node reaches every other member as
``PeerAborted`` within the budget; and a node fence that fails on one node reaches the
other node's members as ``PeerAborted`` at their next exchange, not at their budget, every
member's error naming the origin (rank 3) and its reason, not the member that relayed it; a
``write()`` during CUDA graph capture is refused before it writes or aborts anything.
"""

import itertools
import time

import torch
import torch.distributed as dist
from oracles import GUARD_BYTES, POISON, Cache, delayed_writer, first_difference, prompt, whole_buffer

import symmsync as ss
from symmsync import pcp

NODES = {"SYMMSYNC_NODE_SIZE": "2"}  # the simulated nodes: ranks [0, 1] and [2, 3]
FORMATS = list(itertools.product(("pow2", "fp32"), ("ue8m0", "fp32", "mxfp8")))
#: (tp, route, format): every format on the direct route at both layouts; the all-gather route
#: once per layout (its path does not depend on the format).
CASES = [(tp, "direct", f) for tp in (1, 2) for f in FORMATS] + [
    (1, "allgather", ("fp32", "mxfp8")),
    (2, "allgather", ("pow2", "ue8m0")),
]
TOKENS, BLOCK = 24, 8
LATE_S = 0.2  # the late member's sleep before its write: longer than the others' write and check
BUDGET_S = 30.0  # the writers' wait budget


def _one_node_case(buf, cache, kv, pe, ix, slots):
    """A view within one node (the node's two ranks) in the 2-node buffer: whether the writer took the
    one-node direct route (no node view of its own), and its replica against the oracle."""
    view = buf.view([r for r in range(4) if r // 2 == buf.rank // 2])
    writer = pcp.DirectKVWriter(view, cache.layout, timeout_s=BUDGET_S)
    split = pcp.pcp_split(TOKENS, 2)
    batch = writer.prepare(split.local_slots(slots, view.local_index))
    writer.write(0, *[split.local_rows(t, view.local_index).contiguous() for t in (kv, pe, ix)], batch)
    return writer.node_view is None, first_difference(cache.raw_layer(buf, 0), cache.expected_layer(kv, pe, ix, slots))


def across_nodes():
    """Rank function (``SYMMSYNC_NODE_SIZE=2``): see the module's docstring."""
    nb = -(-TOKENS // BLOCK) + 2  # more slots than tokens: untouched slots stay poisoned
    span = Cache(nb, 1, BLOCK).end + GUARD_BYTES
    caches = [
        Cache(nb, 1, BLOCK, base=GUARD_BYTES + i * span, main_scale=m, indexer_scale=x)
        for i, (_, _, (m, x)) in enumerate(CASES + [(0, "", ("pow2", "ue8m0"))])
    ]
    buf = ss.SymmetricBuffer(caches[-1].end + GUARD_BYTES, backend="host", channels=len(CASES), max_views=40)
    buf.tensor(0, (buf.nbytes,), torch.uint8).fill_(POISON)
    views = {tp: ss.pcp_view(buf, tp=tp) for tp in (1, 2)}
    dist.barrier()  # every replica is poisoned before anyone writes into it
    result = {"nodes": {tp: str(v.nodes) for tp, v in views.items()}}
    wants = []
    for i, ((tp, route, _), cache) in enumerate(zip(CASES, caches)):
        view = views[tp]
        p, me = view.size, view.local_index
        kv, pe, ix, slots = prompt(100 + view.ranks[0], TOKENS, cache.num_slots, special=True)
        slots[torch.arange(TOKENS) % 7 == 3] = -1  # padding inside the prompt
        split = pcp.pcp_split(TOKENS, p)
        writer = pcp.DirectKVWriter(view, cache.layout, route=route, channel=i % 2, timeout_s=BUDGET_S)
        batch = writer.prepare(split.local_slots(slots, me))
        if me == delayed_writer(0, i, p):
            time.sleep(LATE_S)  # a late member: the others' write() must wait for its rows
        writer.write(0, *[split.local_rows(t, me).contiguous() for t in (kv, pe, ix)], batch)
        wants.append(cache.expected_layer(kv, pe, ix, slots))
        result[i] = {
            "bytes": first_difference(cache.raw_layer(buf, 0), wants[-1]),
            "fence_view": list(writer.fence.view.ranks),
            "sent": writer.bytes_per_layer(split.tokens_per_rank),
        }
    # A view within one node, in the same buffer: the one-node route.
    kv, pe, ix, slots = prompt(7, TOKENS, caches[-1].num_slots)
    result["one_node"] = _one_node_case(buf, caches[-1], kv, pe, ix, slots)
    wants.append(caches[-1].expected_layer(kv, pe, ix, slots))
    dist.barrier()  # the whole-buffer check reads what every case wrote
    result["whole_buffer"] = whole_buffer(buf, [(c.base, w) for c, w in zip(caches, wants)])
    # route="direct" on nodes of different sizes: ranks [0, 1, 2] span nodes of 2 and 1 members.
    uneven = buf.view([0, 1, 2] if buf.rank < 3 else [3])
    try:
        pcp.DirectKVWriter(uneven, Cache(nb, 1, BLOCK).layout, timeout_s=BUDGET_S)
        result["uneven"] = None
    except ss.ConfigError as e:
        result["uneven"] = (type(e).__name__, str(e))
    dist.barrier()
    buf.close()
    result["abort"] = _member_closes_on_the_other_node(nb)
    result["node_fence"] = _node_fence_fails_on_the_other_node(nb)
    return result


def _member_closes_on_the_other_node(nb):
    """PCP4 over 2 nodes: after a good layer, rank 3 closes its buffer instead of writing the next;
    every other member's write() must raise PeerAborted within the budget."""
    cache = Cache(nb, 2, BLOCK, base=GUARD_BYTES)
    buf = ss.SymmetricBuffer(cache.end + GUARD_BYTES, backend="host")
    view = ss.pcp_view(buf)
    writer = pcp.DirectKVWriter(view, cache.layout, timeout_s=BUDGET_S)
    kv, pe, ix, slots = prompt(3, TOKENS, cache.num_slots)
    split = pcp.pcp_split(TOKENS, 4)
    batch = writer.prepare(split.local_slots(slots, buf.rank))
    rows = [split.local_rows(t, buf.rank).contiguous() for t in (kv, pe, ix)]
    writer.write(0, *rows, batch)
    dist.barrier()
    if buf.rank == 3:
        buf.close()
        dist.barrier()  # the others close only after every write() returned or raised: none of
        return None  # them learns of the failure from a node-mate's close()
    t0 = time.monotonic()
    try:
        writer.write(1, *rows, batch)
        outcome = None
    except ss.SymmSyncError as e:
        outcome = (type(e).__name__, str(e))
    elapsed = time.monotonic() - t0
    dist.barrier()
    buf.close()
    return outcome, elapsed


def _node_fence_fails_on_the_other_node(nb):
    """PCP4 over 2 nodes: after a good layer, rank 3 aborts its node's view (as a node fence that
    failed there), and every member goes on writing layers. The fence is the node's, so ranks 0 and 1
    learn of it only if the failing node's write() aborts the whole view: their next exchange must
    raise PeerAborted at once, not time out after the budget."""
    cache = Cache(nb, 3, BLOCK, base=GUARD_BYTES)
    buf = ss.SymmetricBuffer(cache.end + GUARD_BYTES, backend="host")
    writer = pcp.DirectKVWriter(ss.pcp_view(buf), cache.layout, timeout_s=BUDGET_S)
    kv, pe, ix, slots = prompt(5, TOKENS, cache.num_slots)
    split = pcp.pcp_split(TOKENS, 4)
    batch = writer.prepare(split.local_slots(slots, buf.rank))
    rows = [split.local_rows(t, buf.rank).contiguous() for t in (kv, pe, ix)]
    capturing = _write_while_capturing(writer, rows, batch)
    writer.write(0, *rows, batch)  # the capture left the writer usable: this raised if it aborted
    dist.barrier()
    if buf.rank == 3:
        writer.node_view.abort("planted: the node fence failed")
    outcome = None
    for layer in (1, 2):
        t0 = time.monotonic()
        try:
            writer.write(layer, *rows, batch)
        except ss.SymmSyncError as e:
            outcome = (layer, type(e).__name__, sorted(getattr(e, "aborted", {})), time.monotonic() - t0, str(e))
            break
    dist.barrier()
    buf.close()
    return outcome, capturing


def _write_while_capturing(writer, rows, batch):
    """write() as if this rank's stream captured a CUDA graph: its exchange between nodes waits
    on the host, so it must be refused before anything is written or aborted."""
    from symmsync import backends

    real = backends.capturing
    backends.capturing = lambda device: True  # what a capturing CUDA stream reports
    try:
        writer.write(0, *rows, batch)
        return None
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e)
    finally:
        backends.capturing = real


def test_across_two_nodes_every_replica_matches_all_gather_and_insert_in_every_format(host_ranks):
    results = host_ranks(across_nodes, 4, env=NODES, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["nodes"] == {1: "2 nodes: [0, 1] [2, 3]", 2: "2 nodes: [0] [1]"}, r["nodes"]
        for i, (tp, route, fmt) in enumerate(CASES):
            assert r[i]["bytes"] == (0, []), (rank, tp, route, fmt, r[i]["bytes"])
            # The fence is the node's: the view's members on this rank's node.
            node = [0, 1] if rank < 2 else [2, 3]
            assert r[i]["fence_view"] == ([m for m in node if m % tp == rank % tp]), (rank, tp, r[i])
        # PCP4 direct, 6 rows a member: its 2 nodes' 12 rows into its node-mate's replica (788 B a row),
        # and its 6 rows of compact KV (1408 B a row) to the other node's member at its position.
        assert r[0]["sent"] == {
            "cache_bytes_written": 24 * 788,
            "sent_to_peers": 12 * 788 + 6 * 1408,
            "sent_off_node": 6 * 1408,
        }, r[0]["sent"]
        ag = CASES.index((1, "allgather", ("fp32", "mxfp8")))
        assert r[ag]["sent"] == {
            "cache_bytes_written": 24 * 788,
            "sent_to_peers": 3 * 6 * 1408,
            "sent_off_node": 2 * 6 * 1408,
        }, r[ag]["sent"]
        assert r["one_node"] == (True, (0, [])), r["one_node"]  # no node view: the one-node route
        assert r["whole_buffer"] == (0, []), r["whole_buffer"]
        kind, msg = r["uneven"]
        assert kind == "ConfigError" and "route='allgather'" in msg and "differ in size" in msg, msg
    for rank, r in enumerate(results[:3]):
        (kind, msg), elapsed = r["abort"]
        assert kind == "PeerAborted" and "rank 3" in msg, (rank, msg)
        assert elapsed < BUDGET_S / 2, (rank, elapsed)
    for rank, r in enumerate(results):
        (layer, kind, aborted, elapsed, msg), capturing = r["node_fence"]
        assert capturing is not None and capturing[0] == "CaptureError", (rank, capturing)
        assert capturing[1].startswith(
            f"rank {rank}: DirectKVWriter.write: called while a CUDA graph was being captured"
        ), capturing
        assert kind == "PeerAborted", (rank, r["node_fence"])
        assert elapsed < BUDGET_S / 2, (rank, r["node_fence"])
        # Every member names the origin (rank 3) and its reason, whoever relayed it (its node-mate's
        # fence, the exchange between nodes, or a node-mate that learnt of it there).
        assert aborted == [3], (rank, r["node_fence"])
        assert "planted: the node fence failed" in msg, (rank, msg)
        assert rank == 3 or "rank 3 " in msg, (rank, msg)  # rank 3's own error says "this rank aborted"
