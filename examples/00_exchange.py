"""The smallest symmsync program: 2 ranks allocate a buffer and exchange data.

    python examples/00_exchange.py            # host backend: 2 processes, no GPU needed

Each rank writes a rank-stamped block into every peer's memory, fences, and reads
back what every peer wrote into its own memory.
"""

import torch

import symmsync as ss
from symmsync.testing import run


def exchange(n: int) -> list[int]:
    with ss.SymmetricBuffer(n * 8 * 8) as buf:  # room for 8 ranks' blocks of n int64
        me, world = buf.rank, buf.world_size
        for peer in range(world):  # my block in every peer's memory, including mine
            buf.tensor(me * n * 8, (n,), torch.int64, rank=peer).fill_(100 + me)
        fence = ss.Fence(buf.view(list(range(world))))
        fence.fence()  # every rank's writes are visible to every rank
        mine = buf.tensor(0, (world, n), torch.int64)
        return [int(v) for v in mine[:, 0]]


if __name__ == "__main__":
    for rank, seen in enumerate(run(exchange, 2, 16)):
        print(f"rank {rank} sees the blocks of ranks 0..1 as {seen}")
