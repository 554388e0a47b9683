"""Tutorial 6: the tensor-parallel all-reduce of a decode step, with symmsync.collectives.

    python examples/06_all_reduce.py                  # host backend: 2 processes, no GPU needed
    python examples/06_all_reduce.py --backend cuda   # one GPU per rank (needs 2 GPUs): adds a CUDA graph
    torchrun --nproc-per-node 2 examples/06_all_reduce.py   # torchrun's processes are the ranks

Every rank holds a partial sum of a layer's output (as the row-parallel projections
of tensor parallelism leave it) and all-reduces it, twice per layer, back to back,
with no host barrier between the calls. After the loop every rank checks each result
against the sum of every rank's inputs, taken in rank order in float32.
"""

# --8<-- [start:imports]
import argparse
import os

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives
from symmsync.testing import is_main_process, run

HIDDEN, TOKENS, LAYERS = 512, 4, 5  # a decode batch of 4 tokens: 2048 values per all-reduce
# --8<-- [end:imports]


# --8<-- [start:setup]
def setup(backend: str) -> tuple[ss.SymmetricBuffer, collectives.AllReduce]:
    world, n = dist.get_world_size(), TOKENS * HIDDEN
    # Once, at start-up: a buffer holding the all-reduce's workspace, the view, the all-reduce.
    buf = ss.SymmetricBuffer(collectives.workspace_bytes(n, torch.bfloat16, world), backend=backend)
    view = buf.view(list(range(buf.world_size)))
    ar = collectives.AllReduce(view, max_numel=n, dtype=torch.bfloat16)  # algorithm="auto"
    return buf, ar
    # --8<-- [end:setup]


# --8<-- [start:decode]
def decode(backend: str) -> list[str]:
    buf, ar = setup(backend)
    gen = torch.Generator().manual_seed(buf.rank)
    inputs, outputs = [], []
    for _layer in range(LAYERS):
        for algorithm in ("one_shot", "two_shot"):  # two all-reduces per layer
            partial = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16).to(buf.device)
            inputs.append(partial)
            outputs.append(ar(partial, algorithm=algorithm))  # one launch; no host barrier
    # The input already in symmetric memory: fill it in place, no copy-in.
    x = ar.input(TOKENS * HIDDEN).view(TOKENS, HIDDEN)
    x.copy_(inputs[0])
    outputs.append(ar(x))
    inputs.append(inputs[0])
    ar.synchronize()  # GPUs: a failed call traps; this raises its error
    # The check, after the loop: every rank's inputs, summed in rank order in float32.
    everyone = [None] * buf.world_size
    dist.all_gather_object(everyone, [t.cpu() for t in inputs])
    for k, out in enumerate(outputs):
        want = everyone[0][k].float()
        for r in range(1, buf.world_size):
            want += everyone[r][k].float()
        assert torch.equal(out.cpu(), want.to(torch.bfloat16)), (buf.rank, k)
    lines = [f"rank {buf.rank}: {len(outputs)} all-reduces of {TOKENS}x{HIDDEN} bfloat16: the rank-order float32 sums"]
    if buf.capabilities.streams:  # CUDA streams, so CUDA graphs
        lines += graph_replays(buf, ar, 100)
    buf.close()
    return lines
    # --8<-- [end:decode]


# --8<-- [start:graph]
def graph_replays(buf: ss.SymmetricBuffer, ar: collectives.AllReduce, replays: int) -> list[str]:
    x = torch.full((TOKENS, HIDDEN), float(buf.rank + 1), dtype=torch.bfloat16, device=buf.device)
    out = torch.empty_like(x)
    ar(x, out)  # compiles the kernel (and packs its launch) before the capture
    ar.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the launch; the epoch (and so the slot) is chosen on the device
        ar(x, out)
    want = float(sum(range(1, buf.world_size + 1)))
    bad = 0
    for _ in range(replays):
        graph.replay()
        ar.synchronize()
        bad += int((out != want).sum())
    return [f"rank {buf.rank}: CUDA graph: {replays} replays, {bad} wrong"]
    # --8<-- [end:graph]


# --8<-- [start:main]
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 6: a decode-time all-reduce")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's ranks, else 2 processes that run() starts
    results = run(decode, world, args.backend, backend=args.backend)
    if is_main_process():  # print once, also under torchrun
        for lines in results:
            print("\n".join(lines))
# --8<-- [end:main]
