"""Where the device memory of a failed mapping goes: free memory at each step, on both ranks (one shared GPU)."""

import time

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync.backends import cuda as cuda_backend
from symmsync.testing import run


def diag(planted: str):
    torch.empty(1, device="cuda")
    with ss.SymmetricBuffer(1 << 22, backend="cuda"):
        pass
    torch.cuda.synchronize()
    dist.barrier()
    time.sleep(0.5)
    f0 = torch.cuda.mem_get_info()[0]
    if dist.get_rank() == 1:

        def broken(self, *a, **k):
            raise ss.BackendError("planted mapping failure")

        setattr(cuda_backend.CudaBackend, planted, broken)
    out = {}
    try:
        ss.SymmetricBuffer(1 << 24, backend="cuda")
    except ss.BackendError as e:
        out["err"] = str(e)[:120]
    torch.cuda.synchronize()
    out["at_raise_MiB"] = (f0 - torch.cuda.mem_get_info()[0]) / 2**20
    dist.barrier()
    time.sleep(1.0)
    out["after_barrier_1s_MiB"] = (f0 - torch.cuda.mem_get_info()[0]) / 2**20
    # a second failed build: does the loss grow by the same amount?
    try:
        ss.SymmetricBuffer(1 << 24, backend="cuda")
    except ss.BackendError:
        pass
    torch.cuda.synchronize()
    dist.barrier()
    time.sleep(1.0)
    out["after_second_MiB"] = (f0 - torch.cuda.mem_get_info()[0]) / 2**20
    return out


if __name__ == "__main__":
    for planted in ("map_chunk", "commit"):
        for r, o in enumerate(run(diag, 2, planted, backend="cuda")):
            print(planted, "rank", r, o, flush=True)
