"""Where a dispatch's time goes: the phase clock of symmsync.moe (SYMMSYNC_MOE_PHASE_TIMES=1).

    PYTHONPATH=. SYMMSYNC_SHARE_GPUS=1 python3 -m symmsync mps run -- \
        python3 benchmarks/moe_phases.py WORLD [cuda|host] [E H K]

Medians in µs per rank and token count (1 and 128 on GPUs). Each dispatch reads its stamps back,
so members are not back to back: the wait phases include the skew between ranks.
"""

import sys

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import moe
from symmsync.testing import run

NAMES = ("A: ids+counts+header", "wait counts", "B: rows (prog 0)", "rest of send", "wait rows", "send start->recv")


def rank(tokens_list, E, H, K, reps, device):
    W, me = dist.get_world_size(), dist.get_rank()
    M = max(tokens_list)
    buf = ss.SymmetricBuffer(moe.buffer_bytes(E, M, H, torch.bfloat16, K, W), backend=device)
    disp = moe.Dispatcher(buf.view(list(range(W))), E, M, H, torch.bfloat16, K)
    dev = buf.device
    assert disp.phase_times.numel() > 1, "made without SYMMSYNC_MOE_PHASE_TIMES=1"
    out = {}
    g = torch.Generator().manual_seed(me)
    for T in tokens_list:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
        w = torch.full((T, K), 1.0 / K, device=dev)
        rows = []
        for i in range(reps):
            recv, counts, handle = disp.dispatch(x, ids)
            t = disp.phase_times[:6].tolist()  # waits for the device
            disp.combine(recv, w, handle)
            if i >= reps // 5:  # warm-up left out
                rows.append([t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3], t[5] - t[4], t[5] - t[0]])
        disp.synchronize()
        out[T] = [round(v / 1000, 2) for v in torch.tensor(rows, dtype=torch.float64).median(0).values.tolist()]
    buf.close()
    return out


if __name__ == "__main__":
    world = int(sys.argv[1])
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    E, H, K = (int(a) for a in sys.argv[3:6]) if len(sys.argv) > 5 else (256, 7168, 8)
    tokens, reps = ([1, 128], 100) if device == "cuda" else ([1, 8], 5)
    results = run(
        rank, world, tokens, E, H, K, reps, device, backend=device, timeout_s=600, env={"SYMMSYNC_MOE_PHASE_TIMES": "1"}
    )
    print("us, median per dispatch:", " | ".join(NAMES))
    for r, res in enumerate(results):
        for T, v in res.items():
            print(f"world {world} rank {r} tokens {T}: {v}")
