"""The direct-KV writer and the fence inside ``torch.compile(fullgraph=True)``: the PCP
decode pattern, against eager and against the plain-torch oracle, on the host backend.

One compiled step is the PCP pattern a model runs per decode step: for every layer, write
this rank's KV rows into every replica (``writer.write``: ``symmsync::kv_write``, or
``symmsync::kv_write_in_order`` under ``aot_eager``, its fence fused), read the local cache
(an attention stand-in: the written slots' rows, gathered, and a sum over the layer's
indexer cache); after the last layer, fence (``symmsync::fence``). Every rank sees every rank's rows right
after the write, so a write that landed late, on a clone, or after the read shows as a
difference. Each run takes 12 steps at world 2 (50 at world 3, with the soaks, ``make
test-soak``) with a varying token count (one dynamic dimension: compiled once), one rank
sleeping a random time before some steps, and compares every step's reads with what plain
torch computes (:func:`oracles.oracle_cache`, independent of the kernels, which eager writes
match byte for byte: tests/pcp), and the whole caches at the end. The unsafe form (the mutating
op under ``aot_eager``, its refusal removed in this file only) runs beside them and must read
stale bytes: the oracle bites.
"""

import random
import time

import pytest
import torch
import torch.distributed as dist
from oracles import Cache, first_difference, oracle_cache

import symmsync as ss
from symmsync import pcp

STEPS = {2: 12, 3: 50}  # decode steps per world (world 3: the soak's)
UNSAFE_STEPS = 6  # the unsafe form's steps: enough to show that it reads stale bytes every step
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


def unsafe_on(writer) -> None:
    """Compile ``writer``'s writes to the unsafe form, in this process only: the mutating
    ``symmsync::kv_write`` whatever the backend (under ``aot_eager`` it runs on a clone of
    the span, copied back at the end of the graph), without the op's refusal of clones.
    Every other writer keeps the shipped dispatch and op body."""

    def trace(layer, kv_c, k_pe, indexer_k, batch):  # this writer's _traced_write, set on the object
        writer.caches(layer)
        span = writer.span(layer)
        return torch.ops.symmsync.kv_write(writer.op_handle, layer, kv_c, k_pe, indexer_k, batch.slots, span)

    def write(layer, kv_c, k_pe, indexer_k, slots, cache):  # the ops' body, without the refusal of clones
        writer.write(layer, kv_c, k_pe, indexer_k, writer.last_batch())  # through its pointers, the clone unused

    writer._traced_write, writer.compiled_write = trace, write


def compiled_decode(modes, steps):
    """Rank function: ``steps`` decode steps, each compiled with every mode of ``modes``
    (``"inductor"``, ``"aot_eager"``, ``"piecewise"``, any other backend by name, or
    ``"unsafe"``: :func:`unsafe_on` under ``aot_eager``, the first 6 steps) on its own cache, steps interleaved;
    returns per mode the steps whose reads differ from plain torch's, the error if one was
    raised, the final caches' differences, the token counts seen and Dynamo's stats."""
    torch._dynamo.reset()  # as in a fresh process: these ranks serve other tests too (tests/conftest.py)
    world, me = dist.get_world_size(), dist.get_rank()
    num_blocks = -(-steps * MAX_ROWS * world // BLOCK)
    caches = [Cache(num_blocks, LAYERS, BLOCK, base=i * (1 << 20)) for i in range(len(modes))]
    buf = ss.SymmetricBuffer(caches[-1].end, backend="host", channels=len(modes))
    view = buf.view(list(range(world)))
    writers = [pcp.DirectKVWriter(view, c.layout, channel=i, timeout_s=60) for i, c in enumerate(caches)]
    if "unsafe" in modes:
        unsafe_on(writers[modes.index("unsafe")])

    def decode(writer, kv, pe, ix, batch, every_slot):
        out = []
        for layer in range(LAYERS):
            writer.write(layer, (kv.float() * (layer + 1)).bfloat16(), pe, ix, batch)
            main, index = writer.caches(layer)
            out.append(main.view(-1, main.shape[-1])[every_slot])  # the rows every rank wrote
            out.append(index.to(torch.int64).sum().reshape(1))
        writer.fence.fence()  # symmsync::fence after the writes and reads: no peer writes the next step before it
        return out

    def decode_unsafe(*args):  # its own code, so that Dynamo's cache keeps it apart from aot_eager's graphs
        return decode(*args)

    backends = [{"piecewise": splitting_backend, "unsafe": "aot_eager"}.get(m, m) for m in modes]
    fns = [decode_unsafe if m == "unsafe" else decode for m in modes]
    compiled = [torch.compile(f, backend=b, fullgraph=True) for f, b in zip(fns, backends)]
    rng = random.Random(7)
    result = {m: {"wrong": [], "error": None} for m in modes}
    rows_seen = set()
    torch._dynamo.utils.counters.clear()
    index_sums = [0] * LAYERS
    for step in range(steps):
        rows, (kv, pe, ix, slots) = step_rows(step, world)
        rows_seen.add(rows)
        want = []  # plain torch: this step's rows, and the indexer caches' running sums
        for layer in range(LAYERS):
            main, index = oracle_cache(caches[0].layout, (kv.float() * (layer + 1)).bfloat16(), pe, ix, slots)
            index_sums[layer] += int(index.to(torch.int64).sum())
            want += [main.view(-1, main.shape[-1])[slots], torch.tensor([index_sums[layer]])]
        mine = [t[me * rows : (me + 1) * rows].contiguous() for t in (kv, pe, ix, slots)]
        for mode, writer, fn in zip(modes, writers, compiled):
            if result[mode]["error"] is not None or (mode == "unsafe" and step >= UNSAFE_STEPS):
                continue
            batch = writer.prepare(mine[3])
            for t in (*mine[:3], batch.slots, slots):
                torch._dynamo.mark_dynamic(t, 0)
            if me == 1 and rng.random() < 0.3:
                time.sleep(rng.random() * 0.05)  # a late peer
            try:
                got = fn(writer, *mine[:3], batch, slots)
            except ss.SymmSyncError as e:
                result[mode]["error"] = f"{type(e).__name__}: {e}"
                continue
            result[mode]["wrong"] += [step] * int(not all(torch.equal(g, w) for g, w in zip(got, want)))
    every = [step_rows(s, world)[1] for s in range(steps)]
    kv, pe, ix, slots = [torch.cat([e[i] for e in every]) for i in range(4)]
    for mode, writer in zip(modes, writers):  # the whole caches, byte for byte, as plain torch makes them
        final = []
        for layer in range(LAYERS):
            if result[mode]["error"] is None:
                want = oracle_cache(caches[0].layout, (kv.float() * (layer + 1)).bfloat16(), pe, ix, slots)
                got = writer.caches(layer)
                final += [first_difference(g.reshape(-1), w.reshape(-1)) for g, w in zip(got, want)]
        result[mode]["final"] = final
    result["rows"] = sorted(rows_seen)
    result["stats"] = dict(torch._dynamo.utils.counters["stats"])
    dist.barrier()
    buf.close()
    return result


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.soak)])  # world 3: make test-soak (CI time)
def test_compiled_pcp_decode_is_bytes_identical_to_plain_torch_and_compiles_once(host_ranks, world):
    modes = ["inductor", "aot_eager", "piecewise"]
    results = host_ranks(compiled_decode, world, [*modes, "unsafe"], STEPS[world], timeout_s=600)
    for r in results:
        for mode in modes:
            assert r[mode]["error"] is None, (mode, r[mode]["error"])
            assert r[mode]["wrong"] == [], (mode, r[mode]["wrong"])
            assert r[mode]["final"] == [(0, [])] * (2 * LAYERS), (mode, r[mode]["final"])
        assert len(r["rows"]) > 1  # the token count varied
        assert r["stats"].get("unique_graphs") == len(modes) + 1, r["stats"]  # one graph per mode for every count
    # The oracle bites: the mutating op on aot_eager's clone, unrefused, reads this step's rows
    # from a copy taken before the write, every step, and its copy back erases them.
    for r in results:
        assert r["unsafe"]["error"] is None and r["unsafe"]["wrong"] == list(range(UNSAFE_STEPS)), r["unsafe"]
        assert r["unsafe"]["final"] != [(0, [])] * (2 * LAYERS), r["unsafe"]["final"]


def first_error(fn, *args) -> str | None:
    """The symmsync error ``fn(*args)`` raises (found in Dynamo's exception chain), or None."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - Dynamo wraps what a fake raises; the cause is symmsync's
        cause = e
        while cause is not None and not isinstance(cause, ss.SymmSyncError):
            cause = cause.__cause__ or cause.__context__
        return f"{type(cause).__name__}: {cause}" if cause is not None else repr(e)
    return None


def refusals() -> tuple[str | None, str | None, str | None]:
    """Rank function: the errors of a write compiled two ways it cannot be ordered: under
    ``aot_eager`` after a plain torch write into the cache in the same graph, then (which
    aborts the view) under ``aot_eager_decomp_partition``."""
    torch._dynamo.reset()
    world, me = dist.get_world_size(), dist.get_rank()
    cache = Cache(1, LAYERS, BLOCK)
    buf = ss.SymmetricBuffer(cache.end, backend="host")
    writer = pcp.DirectKVWriter(buf.view(list(range(world))), cache.layout, timeout_s=60)
    rows, every = step_rows(0, world)
    kv, pe, ix, slots = [t[me * rows : (me + 1) * rows].contiguous() for t in every]
    batch = writer.prepare(slots)

    def step(kv, pe, ix, batch, zero: bool):
        main, _ = writer.caches(0)
        if zero:
            main.zero_()  # deferred by functionalization to the end of the graph, past the write
        writer.write(0, kv, pe, ix, batch)
        return main.view(-1, main.shape[-1])[batch.slots].sum()

    traced = first_error(torch.compile(step, backend="aot_eager", fullgraph=True), kv, pe, ix, batch, True)
    dist.barrier()  # both ranks refused the graph before running any of it
    partitioned = torch.compile(step, backend="aot_eager_decomp_partition", fullgraph=True)
    cloned = first_error(partitioned, kv, pe, ix, batch, False)
    dist.barrier()
    after = first_error(writer.write, 0, kv, pe, ix, batch)  # the refusal failed that write only
    buf.close()
    return traced, cloned, after


def test_compiled_writes_that_cannot_be_ordered_are_refused_on_every_rank(host_ranks):
    for traced, cloned, after in host_ranks(refusals, 2, timeout_s=600):
        # aot_eager: plain writes into symmetric memory before a write, refused while Dynamo traces.
        assert traced is not None and traced.startswith("ConfigError: a compiled DirectKVWriter.write"), traced
        # aot_eager_decomp_partition runs aot_autograd without reinplacing: symmsync::kv_write
        # gets a clone of the span and refuses it at its first call, before writing.
        assert cloned is not None and "passed copies of the caches" in cloned, cloned
        assert after is None, after  # the writer and its view go on: the eager write of the layer ran
