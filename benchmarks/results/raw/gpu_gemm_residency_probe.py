"""The probe behind gpu_gemm_residency_deadlock_h100x1.txt and gpu_gemm_residency_n4096_h100x1.txt:
one AllGatherMatmul call at each row count, 2 ranks sharing one GPU under MPS, a 20 s wait budget.

    PYTHONPATH=. SYMMSYNC_SHARE_GPUS=1 python3 -m symmsync mps run -- python3 \
        benchmarks/results/raw/gpu_gemm_residency_probe.py 2048,4096 14336

Run on the tree before the gemm kernels' sends were claimed (each program took its sends by its
index, and every program was assumed resident).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import gemm
from symmsync.testing import run


def main(ms, k, n, max_rows, timeout):
    w, me = dist.get_world_size(), dist.get_rank()
    bf = torch.bfloat16
    nb = gemm.all_gather_matmul_bytes(w, max_rows, k, bf)
    with ss.SymmetricBuffer(nb, backend="cuda") as buf:
        view = buf.view(list(range(w)))
        with gemm.AllGatherMatmul(view, max_rows, k, bf, timeout_s=timeout) as ag:
            b = torch.randint(-2, 3, (k, n), device=buf.device).to(bf)
            for m in ms:
                a = torch.randint(-2, 3, (m, k), device=buf.device).to(bf)
                try:
                    dist.barrier()
                    torch.cuda.synchronize()
                    t = time.time()
                    ag(a, b)
                    ag.synchronize()
                    torch.cuda.synchronize()
                    print(f"PROBE rank {me} m={m} ok {time.time() - t:.3f}s", flush=True)
                except Exception as e:  # noqa: BLE001 - printed, then the rank ends
                    print(f"PROBE rank {me} m={m}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
                    os._exit(3)


if __name__ == "__main__":
    ms = [int(x) for x in sys.argv[1].split(",")]
    print(run(main, 2, ms, 8192, int(sys.argv[2]), 8192, 20, backend="cuda", timeout_s=300))
