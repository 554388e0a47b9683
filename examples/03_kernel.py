"""Tutorial 3: your own Triton kernel that writes into every peer and fences, with symmsync.language.

    python examples/03_kernel.py                  # host backend: kernels run in Triton's interpreter
    python examples/03_kernel.py --backend cuda   # compiled for the GPUs (needs 2 GPUs)
    torchrun --nproc-per-node 2 examples/03_kernel.py [--backend cuda]   # torchrun's processes are the ranks

Every round, every rank's kernel writes a block of epoch-stamped values into every
member's memory, publishes, and waits for every member; the host then checks what
arrived and fences once more before the blocks are reused.
"""

# --8<-- [start:imports]
import argparse
import os

import torch
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import is_main_process, run

N = 64  # int64 values each rank sends to each member
# --8<-- [end:imports]


# --8<-- [start:kernel]
@triton.jit
def exchange_kernel(data, cells, cell, me, timeout_ns, record, SIZE: tl.constexpr, N: tl.constexpr):
    e = tl.load(ssl.epoch_ptr(cells, cell, me)) + 1  # the epoch publish() will return
    values = e * 1000 + me * 100 + tl.arange(0, N)
    for p in tl.static_range(SIZE):  # my block in every member's memory, mine included
        dst = ssl.peer_ptr(data, p, 0, tl.int64)
        tl.store(dst + me * N + tl.arange(0, N), values)
    tl.debug_barrier()  # every thread's stores before the release
    e = ssl.publish(cells, cell, me, SIZE)  # release, system scope
    ssl.wait_or_trap(cells, cell, me, e, timeout_ns, record, SIZE, False)  # bounded acquire wait
    # --8<-- [end:kernel]


# --8<-- [start:consumer]
def consumer(rounds: int, backend: str) -> int:
    buf = ss.SymmetricBuffer(1 << 16, backend=backend)
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=60)
    for _ in range(rounds):
        # view.ptrs: the members' user regions (the payload); fence.kernel_args: (view.cell_ptrs,
        # fence.cell, view.local_index, fence.timeout_ns, fence.record), the cells apart from them
        exchange_kernel[(1,)](view.ptrs, *fence.kernel_args, SIZE=view.size, N=N)  # one program: one publish
        fence.synchronize()  # raises FenceTimeout if the kernel's wait ran out
        got = buf.tensor(0, (view.size, N), torch.int64).cpu()  # my memory, written by every member
        e = fence.epoch
        want = e * 1000 + torch.arange(view.size)[:, None] * 100 + torch.arange(N)
        assert torch.equal(got, want), (buf.rank, e)
        # A fast member could overwrite this block in its next round before a slow rank
        # read it: fence once more (or double-buffer by epoch parity) before reusing it.
        fence.fence()
    epoch = fence.epoch
    buf.close()
    return epoch
    # --8<-- [end:consumer]


# --8<-- [start:main]
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 3: a Triton kernel")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's ranks, else 2 processes that run() starts
    epochs = run(consumer, world, 5, args.backend, backend=args.backend)
    assert epochs == [10] * world, epochs  # 5 rounds, two fences each
    if is_main_process():  # print once, also under torchrun
        print(f"5 rounds on {world} ranks: every block arrived; epochs {epochs}")
# --8<-- [end:main]
