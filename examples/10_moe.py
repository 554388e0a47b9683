"""Tutorial 10: expert-parallel dispatch and combine for MoE decode (symmsync.moe).

    python examples/10_moe.py                  # host backend: 2 ranks, then 4
    python examples/10_moe.py --backend cuda   # one rank per GPU
    torchrun --nproc-per-node 2 examples/10_moe.py   # torchrun's processes are the ranks

Every rank holds a few tokens and the experts [rank * E / W, (rank + 1) * E / W). A router
picks each token's top-k experts; the dispatch sends every token to the ranks owning them,
each rank runs its experts on the rows it received, and the combine brings the outputs back
and sums them per token with the router's weights. The example checks the result against
the same MoE layer computed on one rank in plain torch, bit for bit, for several layers.
"""

# --8<-- [start:imports]
import argparse
import os

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import moe
from symmsync.testing import is_main_process, run

EXPERTS_PER_RANK, MAX_TOKENS, HIDDEN, TOP_K, LAYERS = 2, 8, 128, 2, 3
# --8<-- [end:imports]


# --8<-- [start:model]
def expert_weights(num_experts: int, device) -> torch.Tensor:
    """Every expert's weights (a vector of HIDDEN each), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(num_experts, HIDDEN, generator=g).to(device)


def route(x: torch.Tensor, num_experts: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A router: each token's top-k experts and their softmax weights (float32)."""
    g = torch.Generator().manual_seed(100 + layer)
    gate = torch.randn(HIDDEN, num_experts, generator=g).to(x.device)
    scores = (x.float() @ gate).softmax(dim=-1)
    weights, ids = scores.topk(TOP_K, dim=-1)
    return ids.contiguous(), weights.contiguous()


def run_expert(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One expert on its rows: an elementwise stand-in for an MLP (silu(rows * w) in float32,
    rounded to bfloat16), so that a row gives the same bits alone or in a batch."""
    return torch.nn.functional.silu(rows.float() * w).to(torch.bfloat16)
    # --8<-- [end:model]


# --8<-- [start:layer]
def moe_layers(backend: str) -> list[str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    num_experts = EXPERTS_PER_RANK * world
    nbytes = moe.buffer_bytes(num_experts, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K, world)
    buf = ss.SymmetricBuffer(nbytes, backend=backend)
    disp = moe.Dispatcher(buf.view(list(range(world))), num_experts, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K)
    dev = buf.device
    w = expert_weights(num_experts, dev)
    mine = range(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    tokens = MAX_TOKENS - rank  # each rank has its own number of tokens
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(dev)
    lines = []
    for layer in range(LAYERS):
        ids, weights = route(x, num_experts, layer)
        recv, counts, handle = disp.dispatch(x, ids)  # recv: [local experts, world * MAX_TOKENS, HIDDEN]
        out = torch.stack([run_expert(w[e], recv[i]) for i, e in enumerate(mine)])
        y = disp.combine(out, weights, handle)  # [tokens, HIDDEN]
        # the same layer on this rank alone, in plain torch: the order docs/moe.md promises
        want = torch.zeros(tokens, HIDDEN, dtype=torch.float32, device=dev)
        for k in range(TOP_K):
            expert_out = torch.stack([run_expert(w[int(e)], x[t : t + 1])[0] for t, e in enumerate(ids[:, k])])
            want = want + weights[:, k : k + 1] * expert_out.float()
        assert torch.equal(y, want.to(torch.bfloat16)), f"rank {rank}: layer {layer} differs"
        lines.append(f"rank {rank}: layer {layer}: {counts.sum().item()} rows for my experts, combine exact")
        x = y
    disp.synchronize()
    dist.barrier()
    buf.close()
    return lines
    # --8<-- [end:layer]


# --8<-- [start:main]
def report(world: int, results: list[list[str]]) -> None:
    if is_main_process():
        for lines in results:
            print("\n".join(lines))
        print(f"{world} ranks: {LAYERS} MoE layers, top-{TOP_K} of {EXPERTS_PER_RANK * world} experts: bit for bit")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 10: MoE dispatch and combine")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # torchrun's ranks
        world = int(os.environ["WORLD_SIZE"])
        report(world, run(moe_layers, world, args.backend, backend=args.backend))
    else:  # run() starts the processes: 2 ranks, then 4 where there are enough
        gpus = torch.cuda.device_count() if args.backend == "cuda" else 4
        for world in [w for w in (2, 4) if w <= gpus or os.environ.get("SYMMSYNC_SHARE_GPUS") == "1"]:
            report(world, run(moe_layers, world, args.backend, backend=args.backend))
# --8<-- [end:main]
