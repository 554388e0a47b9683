"""Views that span nodes on the CUDA backend: 2 simulated nodes x 2 ranks (GPUs).

Marker ``gpu``: skipped where fewer than 4 GPUs exist, unless ``SYMMSYNC_SHARE_GPUS=1`` (the
four ranks then share the GPUs there are, over gloo). ``SYMMSYNC_NODE_SIZE=2`` makes world
ranks 0, 1 one node and 2, 3 the other. The CUDA backend must map only same-node peers (an
off-node rank's memory is refused), the collectives over the spanning view must give the
order of additions docs/collectives.md states ("Across nodes": each node's members in
float32, rounded to the dtype, then the node partials in float32 in node order), written
here in plain torch from the gathered inputs, and the PCP writer must leave every replica as
an all-gather and insert in plain torch does (:meth:`oracles.Cache.expected_layer`). The
all-reduce and the writer's ``write()`` over the spanning view, called inside a real CUDA
graph capture, must raise ``CaptureError`` before they run (the eager calls after them work).
"""

import pytest
import torch
import torch.distributed as dist
from oracles import GUARD_BYTES, Cache, first_difference, prompt

import symmsync as ss
from symmsync import collectives as C
from symmsync import pcp
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD, NODE_SIZE, NUMEL, TOKENS, BLOCK = 4, 2, 4096, 64, 16


def node_order_sum(inputs, dtype):
    """The stated order: nodes [0, 1] and [2, 3] (view of every rank, in rank order)."""
    partials = [(inputs[n].float() + inputs[n + 1].float()).to(dtype) for n in (0, 2)]
    return (partials[0].float() + partials[1].float()).to(dtype)


def _in_capture(call):
    """``call()`` inside a CUDA graph capture: the error's type and the start of its message."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            call()
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e).split(": called")[0]
    return None


def spanning():
    """Rank function: what this rank saw (layout, refusal, and each check's first differences)."""
    rank, dev = dist.get_rank(), None
    cache = Cache(-(-TOKENS // BLOCK), 1, BLOCK)
    sizes = [C.workspace_bytes(NUMEL, torch.bfloat16, WORLD, op, nodes=2) for op in ("all_reduce", "all_gather")]
    at = cache.end + GUARD_BYTES
    buf = ss.SymmetricBuffer(at + sum(sizes), backend="cuda", channels=4)  # the view's node steps: 2 + 1, the writer 1
    dev = buf.device
    buf.tensor(0, (buf.nbytes,), torch.uint8).zero_()  # untouched cache bytes read as the oracle's fill
    torch.cuda.synchronize()
    dist.barrier()
    out = {"nodes": str(buf.nodes), "rank": rank}
    off_node = (rank + NODE_SIZE) % WORLD
    try:
        buf.tensor(0, (16,), torch.uint8, rank=off_node)
        out["off_node"] = None
    except ss.SymmSyncError as e:
        out["off_node"] = type(e).__name__
    view = buf.view(list(range(WORLD)))
    ar = C.AllReduce(view, NUMEL, torch.bfloat16, offset=at, channel=0, timeout_s=60)
    ag = C.AllGather(view, NUMEL // WORLD, torch.bfloat16, offset=at + sizes[0], channel=1, timeout_s=60)
    g = torch.Generator().manual_seed(50 + rank)
    x = (torch.randn(NUMEL, generator=g) * torch.exp(torch.randn(NUMEL, generator=g) * 3)).bfloat16()
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, x)
    x_dev = x.to(dev)
    out["captured"] = [_in_capture(lambda: ar(x_dev))]  # refused before it runs: the eager call below works
    got = ar(x_dev).cpu()
    out["all_reduce"] = first_difference(
        got.view(torch.int16), node_order_sum(everyone, torch.bfloat16).view(torch.int16)
    )
    got = ag(x[: NUMEL // WORLD].to(dev)).cpu()
    out["all_gather"] = first_difference(
        got.view(torch.int16), torch.cat([e[: NUMEL // WORLD] for e in everyone]).view(torch.int16)
    )
    # The PCP writer over the 4 ranks: direct within each node, gathered between the nodes.
    writer = pcp.DirectKVWriter(view, cache.layout, timeout_s=60)
    kv, pe, ix, slots = prompt(9, TOKENS, cache.num_slots, special=True)
    split = pcp.pcp_split(TOKENS, WORLD)
    batch = writer.prepare(split.local_slots(slots, rank).to(dev))
    rows = [split.local_rows(t, rank).contiguous().to(dev) for t in (kv, pe, ix)]
    out["captured"].append(_in_capture(lambda: writer.write(0, *rows, batch)))
    writer.write(0, *rows, batch)
    torch.cuda.synchronize()
    out["writer"] = first_difference(cache.raw_layer(buf, 0).cpu(), cache.expected_layer(kv, pe, ix, slots, fill=0))
    dist.barrier()
    buf.close()
    return out


def test_a_spanning_view_on_cuda_maps_only_its_node_and_matches_the_oracles():
    for r in run(spanning, WORLD, backend="cuda", env={"SYMMSYNC_NODE_SIZE": str(NODE_SIZE)}, timeout_s=400):
        assert r["nodes"] == "2 nodes: [0, 1] [2, 3]", r
        assert r["off_node"] == "ViewError", r
        rank = r["rank"]
        assert r["captured"] == [
            ("CaptureError", f"rank {rank}: AllReduce over a view that spans 2 nodes"),
            ("CaptureError", f"rank {rank}: DirectKVWriter.write"),
        ], r
        assert (r["all_reduce"], r["all_gather"], r["writer"]) == ((0, []), (0, []), (0, [])), r
