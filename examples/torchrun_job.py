"""A plain torchrun job: the program a user writes, with no symmsync test helper.

    torchrun --nproc-per-node 2 examples/torchrun_job.py   # CPU: gloo, host backend
    torchrun --nproc-per-node 2 examples/torchrun_job.py   # 2 GPUs: NCCL, cuda backend

torchrun starts one process per rank and tells each its rank through the environment;
the program initializes torch.distributed, allocates a buffer, writes into its right
neighbour's memory, fences, and checks what its left neighbour wrote into its own.
On a machine without a GPU, ``import symmsync`` turns on Triton's interpreter.
"""

# --8<-- [start:job]
import os

import torch
import torch.distributed as dist

import symmsync as ss


def main() -> None:
    if torch.cuda.is_available():  # one GPU per process
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:  # CPU only: gloo, shared memory, kernels in Triton's interpreter
        dist.init_process_group("gloo")
    with ss.SymmetricBuffer(1 << 20) as buf:  # collective: every rank allocates, maps every peer
        right = (buf.rank + 1) % buf.world_size
        peer = buf.tensor(0, (256,), torch.float32, rank=right)
        peer.fill_(buf.rank)  # write straight into the right neighbour's memory
        fence = ss.Fence(buf.view(list(range(buf.world_size))))
        fence.fence()  # one launch: publish, then wait for every rank
        mine = buf.tensor(0, (256,), torch.float32)  # what the left neighbour wrote
        left = (buf.rank - 1) % buf.world_size
        assert bool((mine == left).all()), mine
        print(f"rank {buf.rank}: {buf.backend} backend: rank {left}'s 256 values arrived", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
# --8<-- [end:job]
