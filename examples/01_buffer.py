"""Tutorial 1: allocate a SymmetricBuffer, write into a peer's memory, read a peer's memory.

    python examples/01_buffer.py                  # host backend: 2 processes, no GPU needed
    python examples/01_buffer.py --backend cuda   # one GPU per rank (needs 2 GPUs)
    torchrun --nproc-per-node 2 examples/01_buffer.py [--backend cuda]   # torchrun's processes are the ranks

Every rank stores the value 10 * writer + owner into its own row of every rank's
memory, fences, then reads its own memory and its right neighbour's.
"""

# --8<-- [start:example]
import argparse
import os

import torch

import symmsync as ss
from symmsync.testing import is_main_process, run


def exchange(backend: str) -> list[str]:  # runs on every rank, with torch.distributed initialized
    with ss.SymmetricBuffer(1024, backend=backend) as buf:  # 1024 bytes on every rank (collective)
        me, world = buf.rank, buf.world_size
        for owner in range(world):  # row `me` of every rank's memory, mine included
            buf.tensor(me * 16, (2,), torch.int64, rank=owner).fill_(10 * me + owner)
        ss.Fence(buf.view(list(range(world)))).fence()  # every rank's stores are visible
        right = (me + 1) % world
        mine = buf.tensor(0, (world, 2), torch.int64)  # a view of memory, not a copy
        theirs = buf.tensor(0, (world, 2), torch.int64, rank=right)
        return [
            f"rank {me}: {buf.backend} backend, {buf.nbytes} bytes on {buf.device}",
            f"rank {me}: my memory holds {mine[:, 0].tolist()}",
            f"rank {me}: rank {right}'s memory holds {theirs[:, 0].tolist()}",
        ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 1: a buffer and a peer")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's ranks, else 2 processes that run() starts
    results = run(exchange, world, args.backend, backend=args.backend)  # every rank's lines
    if is_main_process():  # under torchrun every rank gets the results: print them once
        for lines in results:
            print("\n".join(lines))
# --8<-- [end:example]
