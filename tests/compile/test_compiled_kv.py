"""The direct-KV writer and the fence inside ``torch.compile(fullgraph=True)``: the PCP
decode pattern, against eager and against the plain-torch oracle, on the host backend.

One compiled step is the PCP pattern a model runs per decode step: for every layer, write
this rank's KV rows into every replica (``writer.write``: the ``symmsync::kv_write`` op,
its fence fused), then read the local cache (an attention stand-in: the written slots'
rows, gathered, and a sum over the layer's indexer cache). Every rank sees every rank's
rows right after the write, so a write that landed late, on a clone, or after the read
shows as a difference. Each run takes 50 steps with a varying token count (one dynamic
dimension: compiled once), one rank sleeping a random time before some steps, and
compares every step's reads with the same step run eagerly on a second cache in the same
buffer, and both caches with :func:`oracles.oracle_cache` (plain torch) at the end.
"""

import random
import time

import pytest
import torch
import torch.distributed as dist
from oracles import Cache, first_difference, oracle_cache

import symmsync as ss
from symmsync import pcp
from symmsync.testing import run

STEPS = int(__import__("os").environ.get("H5_STEPS", 50))
LAYERS = 2
BLOCK = 64
MAX_ROWS = 3  # per rank per step; at least 2 (a size-1 dimension would be specialized)


def step_rows(step: int, world: int) -> tuple[int, list[torch.Tensor]]:
    """``(rows per rank, [kv_c, k_pe, indexer_k, slots] of every rank, rank-major)`` of a
    step, the same on every rank: each step's tokens take fresh slots (a decode step)."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = int(torch.randint(2, MAX_ROWS + 1, (1,), generator=g))
    n = rows * world
    kv = torch.randn(n, 512, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 2)
    pe, ix = torch.randn(n, 64, generator=g), torch.randn(n, 128, generator=g) * 10
    slots = step * MAX_ROWS * world + torch.randperm(n, generator=g)
    return rows, [kv.bfloat16(), pe.bfloat16(), ix.bfloat16(), slots]


def splitting_backend(gm: torch.fx.GraphModule, example_inputs):
    """A piecewise backend as vLLM's: split the Dynamo graph at the symmsync ops (its
    ``splitting_ops``), run those between the pieces as they are, compile the pieces."""
    from torch.fx.passes.split_module import split_module

    part, parts = 0, {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("symmsync."):
            part += 1
            parts[node] = part  # the op alone in its piece
            part += 1
        else:
            parts[node] = part
    split = split_module(gm, None, lambda node: parts[node], keep_original_order=True)  # as vLLM does
    splits = {parts[n] for n in parts if n.op == "call_function" and str(n.target).startswith("symmsync.")}
    for name, piece in list(split.named_children()):
        if int(name.removeprefix("submod_")) not in splits:
            setattr(split, name, torch.compile(piece, backend="aot_eager", dynamic=True))
    splitting_backend.pieces = len(list(split.named_children()))
    return split


def compiled_decode(mode):
    """Rank function: 50 decode steps compiled with ``mode`` (``"inductor"``, ``"aot_eager"``
    or ``"piecewise"``) and eagerly; returns what differs."""
    world, me = dist.get_world_size(), dist.get_rank()
    caches = [Cache(-(-STEPS * MAX_ROWS * world // BLOCK), LAYERS, BLOCK, base=i * (1 << 20)) for i in range(2)]
    buf = ss.SymmetricBuffer(caches[1].end, backend="host", channels=2)
    view = buf.view(list(range(world)))
    writers = [pcp.DirectKVWriter(view, c.layout, channel=i, timeout_s=60) for i, c in enumerate(caches)]

    def decode(writer, kv, pe, ix, batch, every_slot):
        out = []
        for layer in range(LAYERS):
            writer.write(layer, (kv.float() * (layer + 1)).bfloat16(), pe, ix, batch)
            main, index = writer.caches(layer)
            out.append(main.view(-1, main.shape[-1])[every_slot])  # the rows every rank wrote
            out.append(index.to(torch.int64).sum().reshape(1))
        return out

    backend = {"piecewise": splitting_backend}.get(mode, mode)
    compiled = torch.compile(decode, backend=backend, fullgraph=True)
    rng = random.Random(7)
    wrong, rows_seen, error = [], set(), None
    torch._dynamo.utils.counters.clear()
    for step in range(STEPS):
        rows, (kv, pe, ix, slots) = step_rows(step, world)
        rows_seen.add(rows)
        mine = [t[me * rows : (me + 1) * rows].contiguous() for t in (kv, pe, ix, slots)]
        got_want = []
        for writer, fn in zip(writers, (compiled, decode)):
            batch = writer.prepare(mine[3])
            args = [*mine[:3], batch, slots]
            if fn is compiled:
                for t in (*mine[:3], batch.slots, slots):
                    torch._dynamo.mark_dynamic(t, 0)
            if me == 1 and rng.random() < 0.3:
                time.sleep(rng.random() * 0.05)  # a late peer
            try:
                got_want.append(fn(writer, *args))
            except ss.SymmSyncError as e:
                error = f"{type(e).__name__}: {e}"
                break
        if error is not None:
            break
        wrong += [step] * int(not all(torch.equal(a, b) for a, b in zip(*got_want)))
    final = None
    if error is None:  # both caches hold, byte for byte, what plain torch computes for every step
        every = [step_rows(s, world)[1] for s in range(STEPS)]
        kv, pe, ix, slots = [torch.cat([e[i] for e in every]) for i in range(4)]
        final = []
        for layer in range(LAYERS):
            want = oracle_cache(caches[0].layout, (kv.float() * (layer + 1)).bfloat16(), pe, ix, slots)
            for writer in writers:
                got = writer.caches(layer)
                final += [first_difference(g.reshape(-1), w.reshape(-1)) for g, w in zip(got, want)]
    counters = dict(torch._dynamo.utils.counters["stats"])
    dist.barrier()
    buf.close()
    return {"wrong": wrong, "error": error, "final": final, "rows": sorted(rows_seen), "stats": counters}


@pytest.mark.parametrize("mode", ["inductor", "piecewise"])
@pytest.mark.parametrize("world", [2, 3])
def test_compiled_pcp_decode_is_bytes_identical_to_eager_and_compiles_once(mode, world):
    for r in run(compiled_decode, world, mode, timeout_s=600):
        assert r["error"] is None, r["error"]
        assert r["wrong"] == [], r["wrong"]
        assert r["final"] == [(0, [])] * (2 * 2 * LAYERS), r["final"]
        assert len(r["rows"]) > 1  # the token count varied
        assert r["stats"].get("unique_graphs") == 1, r["stats"]  # one graph for every token count


def test_aot_eager_raises_instead_of_writing_on_a_clone():
    for r in run(compiled_decode, 2, "aot_eager", timeout_s=600):
        assert r["error"] is not None and "passed copies of the caches" in r["error"], r["error"]
