"""Tutorial 5: the writer on a runtime's own, growable KV cache.

    python examples/05_runtime_cache.py                   # host backend: 2 processes, no GPU needed
    python examples/05_runtime_cache.py --backend cuda    # one GPU per rank (needs 2 GPUs)
    torchrun --nproc-per-node 2 examples/05_runtime_cache.py

A serving runtime owns its KV cache: its allocator reserves address space once and
commits memory into it as the cache grows (here symmsync.tools.runtime_alloc stands in for
it), and it holds one main-KV and one indexer-K tensor per layer over that memory,
block by block. symmsync registers the memory (mapping every peer's), the PCP writer
writes into the runtime's own tensors, the per-layer publication is captured in a
CUDA graph (on GPUs), the runtime grows its cache, and the same graph keeps
publishing, into blocks that existed before the grow and blocks that did not. Every
rank checks its replica, read through the runtime's own tensors, byte for byte
against the cache format's rules.
"""

import argparse
import os

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import pcp
from symmsync.testing import is_main_process, run
from symmsync.tools.runtime_alloc import block_major_caches, cache_allocator

LAYERS, BLOCK, TOKENS = 2, 64, 128
MAX_BLOCKS = {"host": 16, "cuda": 128}  # room for several chunks of each allocator (2 MiB on GPUs)


# --8<-- [start:runtime]
def serve(backend: str) -> str:
    me, max_blocks = dist.get_rank(), MAX_BLOCKS[backend]
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    # The runtime: reserve room for max_blocks blocks of every layer, commit a few.
    block_bytes = LAYERS * BLOCK * (656 + 132 + 1)  # a block of every layer (more than enough)
    cache = cache_allocator(max_blocks * block_bytes, device)
    cache.commit(max(1, cache.max_bytes // cache.chunk // 4))  # about a quarter, whole chunks
    main, indexer, _ = block_major_caches(cache.reserved(), LAYERS, max_blocks, BLOCK)

    # symmsync: register the runtime's memory (no byte of it is written), a view, the writer.
    buf = ss.SymmetricBuffer.register(cache.base, cache.committed, max_nbytes=cache.max_bytes, device=device)
    view = ss.pcp_view(buf)
    writer = pcp.DirectKVWriter(view, pcp.CacheTensors(main, indexer))  # tensors at the runtime's offsets
    old_blocks = writer.usable_blocks  # blocks of every layer the committed memory holds

    # Static inputs, as a runtime keeps them for its graphs: this rank's rows and slot mapping.
    split = pcp.pcp_split(TOKENS, view.size)
    rows = TOKENS // view.size
    kv_c, k_pe, idx_k = (torch.zeros(LAYERS, rows, w, dtype=torch.bfloat16, device=device) for w in (512, 64, 128))
    slots = torch.full((rows,), -1, dtype=torch.int64, device=device)

    def new_batch(seed: int, first: int, last: int):
        """The prompt of one batch (the same on every rank), its tokens in blocks [first, last)."""
        g = torch.Generator().manual_seed(seed)
        full = [torch.randn(LAYERS, TOKENS, w, generator=g).to(torch.bfloat16) for w in (512, 64, 128)]
        where = first * BLOCK + torch.randperm((last - first) * BLOCK, generator=g)[:TOKENS]
        for static, x in zip((kv_c, k_pe, idx_k), full):
            static.copy_(torch.stack([split.local_rows(x[i], view.local_index) for i in range(LAYERS)]))
        slots.copy_(split.local_slots(where, view.local_index))
        return full, where

    def publish(batch) -> None:  # every layer: the writer's launch and its fence
        for layer in range(LAYERS):
            writer.write(layer, kv_c[layer], k_pe[layer], idx_k[layer], batch)

    # Batch 1, into blocks committed at start-up. On GPUs, capture it in a CUDA graph.
    prompts = [new_batch(1, 0, old_blocks)]
    batch = writer.prepare(slots)  # validates the mapping; the graph reads `slots` in place
    graph = capture(publish, batch) if backend == "cuda" else None
    graph.replay() if graph else publish(batch)

    # The runtime grows its cache; symmsync maps the peers' new memory. Addresses do not move.
    cache.commit(cache.max_bytes // cache.chunk - cache.committed // cache.chunk)
    buf.grow(cache.committed)

    # Batch 2, into blocks that did not exist when the graph was captured: the same graph.
    prompts.append(new_batch(2, old_blocks, max_blocks))
    batch = writer.prepare(slots)  # the new mapping, checked against the grown cache
    graph.replay() if graph else publish(batch)
    writer.fence.fence()  # every member's writes are in every replica
    if backend == "cuda":
        torch.cuda.synchronize()

    for full, where in prompts:  # my replica, read through the runtime's own tensors
        for layer in range(LAYERS):
            check(main[layer], indexer[layer], [x[layer] for x in full], where)
    writer.fence.fence()  # nobody unmaps while a member still writes
    buf.close()  # unmaps the peers' memory here; releases nothing of the runtime's
    dist.barrier()  # every rank closed: only now may the runtimes free their memory
    cache.free()
    return (
        f"rank {me}: the cache grew from {old_blocks} to {max_blocks} blocks\n"
        f"rank {me}: {LAYERS} layers x 2 batches, in blocks from before and after the grow: OK"
    )
    # --8<-- [end:runtime]


def capture(publish, batch) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        publish(batch)  # the first launch compiles; capture the second
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        publish(batch)
    return graph


# --8<-- [start:check]
def check(main: torch.Tensor, indexer: torch.Tensor, x: list, slots: torch.Tensor) -> None:
    """The cache format's rules (default formats), in plain torch, byte for byte."""
    kv_c, k_pe, idx_k = (t.float() for t in x)
    main, indexer = main.cpu(), indexer.cpu()
    block, off = slots // BLOCK, slots % BLOCK
    # Main KV: 4 tiles of 128 values, each scaled by the power of two >= max(amax / 448, 1e-4).
    tiles = kv_c.reshape(-1, 4, 128)
    s = pow2_at_least(torch.clamp(tiles.abs().amax(-1, keepdim=True) / 448, min=1e-4))
    codes = (tiles / s).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, 512)
    row = torch.cat([codes, s.reshape(-1, 4).contiguous().view(torch.uint8), x[1].contiguous().view(torch.uint8)], 1)
    assert torch.equal(main[block, off], row)
    # Indexer K: 128 values scaled by the power of two >= max(amax, 1e-4) / 448, scales after the block's values.
    si = pow2_at_least(torch.clamp(idx_k.abs().amax(-1, keepdim=True), min=1e-4) / 448)
    values = torch.stack([indexer[b, o * 128 : o * 128 + 128] for b, o in zip(block, off)])
    assert torch.equal(values, (idx_k / si).to(torch.float8_e4m3fn).view(torch.uint8))
    fields = torch.stack([indexer[b, BLOCK * 128 + o * 4 : BLOCK * 128 + o * 4 + 4] for b, o in zip(block, off)])
    assert torch.equal(fields.view(torch.float32), si)


def pow2_at_least(m: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= m (m > 0)."""
    e = torch.ceil(torch.log2(m.double()))
    return torch.exp2(e).float()
    # --8<-- [end:check]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 5: the writer on a runtime's growable cache")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's ranks, else 2 processes that run() starts
    lines = run(serve, world, args.backend, backend=args.backend)
    if is_main_process():
        print("\n".join(lines))
