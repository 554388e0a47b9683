"""Tutorial 2: fences, split-phase fences, and fences captured in a CUDA graph.

    python examples/02_fences.py                  # host backend: 2 processes, no GPU needed
    python examples/02_fences.py --backend cuda   # adds the CUDA-graph part (needs 2 GPUs)
    torchrun --nproc-per-node 2 examples/02_fences.py [--backend cuda]   # torchrun's processes are the ranks

Each step, every rank stores a step-stamped value into its own row of every rank's
memory, fences, copies what arrived, and fences again before the rows are reused.
"""

import argparse
import os

import torch

import symmsync as ss
from symmsync.testing import is_main_process, run

N = 8  # int64 values per row


# --8<-- [start:step]
def send(buf: ss.SymmetricBuffer, value: torch.Tensor) -> None:
    """Store ``value`` (one element, on the buffer's device) into my row of every rank's memory."""
    for owner in range(buf.world_size):
        buf.tensor(buf.rank * N * 8, (N,), torch.int64, rank=owner).copy_(value.expand(N))


def step(buf: ss.SymmetricBuffer, fence: ss.Fence, counter: torch.Tensor, seen: torch.Tensor) -> None:
    """One exchange; ``seen`` gets the first value of every rank's row."""
    counter.add_(1)  # on the device, so that a CUDA graph replay counts too
    send(buf, counter * 100 + buf.rank)
    fence.fence()  # (1) every rank's rows are in my memory
    seen.copy_(buf.tensor(0, (buf.world_size, N), torch.int64)[:, 0])
    fence.fence()  # (2) every rank has copied its rows: the next step may overwrite them
    # --8<-- [end:step]


# --8<-- [start:split]
def split_phase(buf: ss.SymmetricBuffer, fence: ss.Fence, counter: torch.Tensor, seen: torch.Tensor) -> int:
    """The first fence of step(), split in two so that local work runs in between."""
    counter.add_(1)
    send(buf, counter * 100 + buf.rank)
    fence.arrive()  # publish: my rows are on their way; returns at once
    local = int(torch.arange(1000, device=buf.device).sum())  # work that reads no peer data
    fence.wait()  # every rank arrived: its rows are in my memory
    seen.copy_(buf.tensor(0, (buf.world_size, N), torch.int64)[:, 0])
    with fence.overlap():  # the second fence, concurrent with the body (on GPUs)
        local += int(torch.arange(10, device=buf.device).sum())
    return local
    # --8<-- [end:split]


# --8<-- [start:graph]
def graph_replays(buf: ss.SymmetricBuffer, fence: ss.Fence, counter, seen, replays: int) -> list[str]:
    """Capture step() once, replay it; the device epoch advances on every replay (GPUs only)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the kernels; runs nothing
        step(buf, fence, counter, seen)
    before, start, bad = fence.epoch, int(counter.item()), 0
    for k in range(1, replays + 1):
        graph.replay()
        fence.synchronize()  # wait for the device; a fence timeout raises FenceTimeout here
        want = [100 * (start + k) + r for r in range(buf.world_size)]
        bad += seen.tolist() != want
    return [f"rank {buf.rank}: CUDA graph: {replays} replays, epoch +{fence.epoch - before}, {bad} wrong"]
    # --8<-- [end:graph]


# --8<-- [start:main]
def fences(steps: int, replays: int, backend: str) -> list[str]:
    with ss.SymmetricBuffer(1 << 12, backend=backend) as buf:
        fence = ss.Fence(buf.view(list(range(buf.world_size))), timeout_s=60)
        counter = torch.zeros((), dtype=torch.int64, device=buf.device)
        seen = torch.zeros(buf.world_size, dtype=torch.int64, device=buf.device)
        lines = []
        for _ in range(steps):
            step(buf, fence, counter, seen)
            lines.append(f"rank {buf.rank}: step {int(counter)}: saw {seen.tolist()}, epoch {fence.epoch}")
        local = split_phase(buf, fence, counter, seen)
        lines.append(f"rank {buf.rank}: split phase: saw {seen.tolist()}, epoch {fence.epoch}, local {local}")
        if buf.capabilities.streams:  # CUDA streams, so CUDA graphs
            lines += graph_replays(buf, fence, counter, seen, replays)
        return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 2: fences")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's ranks, else 2 processes that run() starts
    results = run(fences, world, 3, 100, args.backend, backend=args.backend)
    if is_main_process():  # print once, also under torchrun
        for lines in results:
            print("\n".join(lines))
        if args.backend != "cuda":
            print("CUDA graph part not run: it needs GPUs (python examples/02_fences.py --backend cuda)")
# --8<-- [end:main]
