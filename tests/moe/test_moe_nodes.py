"""Signals and symmsync.moe on a node's own view in a job split into nodes: world 4 as 2 simulated
nodes x 2 ranks (``SYMMSYNC_NODE_SIZE=2``: ranks [0, 1] and [2, 3]), host backend.

Each node's members make a :class:`~symmsync.Signals` object and a :class:`~symmsync.moe.Dispatcher`
on ``buf.view(<their node's ranks>)``, at the same time as the other node makes its own (every
rank of the buffer's group constructs at once). Oracles: each member's slots hold what its node
peer signalled (and the counted waits consumed it); every dispatch's received rows, counts and
source indices, and every combined output, equal the plain-torch oracle's (``moe_oracle.py``)
over the node's two members, bit for bit, for every kind of routing.
"""

import routings
import torch
import torch.distributed as dist
from test_moe import compare, layer

import symmsync as ss
from symmsync import moe
from symmsync.core.nodes import NODE_SIZE_ENV

NODES = {NODE_SIZE_ENV: "2"}
E, M, H, K = 4, 4, 32, 2


def on_a_node_view(seed):
    me = dist.get_rank()
    node = [0, 1] if me < 2 else [2, 3]
    buf = ss.SymmetricBuffer(moe.buffer_bytes(E, M, H, torch.bfloat16, K, 2), backend="host")
    try:
        view = buf.view(node)
        i, peer = view.local_index, 1 - view.local_index
        sigs = ss.Signals(view, slots=2, timeout_s=60)
        sigs.signal(peer, 1, 5 + me)
        sigs.wait_count(peer, 1, 5 + node[peer])
        got = {"values": sigs.values().tolist(), "consumed": sigs.consumed().tolist()}
        want_row = [0, 5 + node[peer]]
        got["signals_ok"] = got["values"][peer] == want_row and got["consumed"][peer] == want_row
        sigs.close()
        disp = moe.Dispatcher(view, E, M, H, torch.bfloat16, K, timeout_s=60)
        wrong = []
        for n, kind in enumerate(routings.KINDS):
            x, ids, w = routings.routing(kind, i, 2, E, M, H, K, torch.bfloat16, seed + n)
            out = layer(disp, x, ids, w)
            everyone = [None] * 4
            dist.all_gather_object(everyone, (x, ids, w))
            xs, idss, ws = ([everyone[r][j] for r in node] for j in range(3))
            wrong += [f"{kind}: {s}" for s in compare(disp, n, out, (xs, idss, ws), i)]
        got["wrong"] = wrong
        disp.close()
        return got
    finally:
        buf.close()


def test_signals_and_a_dispatcher_on_a_node_view_work_at_2_nodes_x_2(host_ranks):
    results = host_ranks(on_a_node_view, 4, 1234, env=NODES, timeout_s=240)
    for rank, got in enumerate(results):
        assert got["signals_ok"], (rank, got)
        assert got["wrong"] == [], (rank, got["wrong"])
