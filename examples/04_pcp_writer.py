"""Tutorial 4: the PCP direct-KV writer, wired the way a runtime wires it.

    python examples/04_pcp_writer.py                  # host backend: 2 processes, no GPU needed
    python examples/04_pcp_writer.py --backend cuda   # one GPU per rank (needs 2 GPUs)
    python examples/04_pcp_writer.py --route allgather  # the baseline route: same bytes
    torchrun --nproc-per-node 2 examples/04_pcp_writer.py  # torchrun's processes are the ranks

Two ranks share one prompt (prefill context parallelism, PCP2). Each computes K/V
for its own tokens only, and the writer stores their final cache bytes into both
ranks' replicas. Then every rank reads its replica the way attention would and
checks it against the prompt.
"""

import argparse
import os

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import pcp
from symmsync.testing import is_main_process, run

TOKENS, LAYERS = 100, 2


def prompt(layers: int, tokens: int, num_slots: int) -> tuple[torch.Tensor, ...]:
    """A stand-in for the model: the same K/V inputs and slot mapping on every rank (seeded)."""
    gen = torch.Generator().manual_seed(0)
    kv_c, k_pe, idx_k = (torch.randn(layers, tokens, w, generator=gen).to(torch.bfloat16) for w in (512, 64, 128))
    slots = torch.randperm(num_slots, generator=gen)[:tokens]  # where each token's cache row goes
    return kv_c, k_pe, idx_k, slots


# --8<-- [start:runtime]
def prefill(tp: int, backend: str, route: str = "direct") -> str:
    # Once, at start-up: the layout (default formats: power-of-two scales), the buffer,
    # the rank's PCP view, the writer.
    layout = pcp.CacheLayout(num_blocks=TOKENS // 64 + 1, num_layers=LAYERS)
    buf = ss.SymmetricBuffer(layout.end, backend=backend)  # every rank's replica of every layer
    view = ss.pcp_view(buf, tp=tp)  # rank = pcp_rank * tp + tp_rank
    writer = pcp.DirectKVWriter(view, layout, route=route)  # and its fence, on channel 0
    for layer in range(LAYERS):  # device memory is not zeroed: clear my replica, fence once
        layout.layer_backing(buf, layer).zero_()
    ss.Fence(view, channel=1).fence()  # channel 1: the writer's fence uses channel 0

    # Once per batch: this rank's rows of the prompt, and its slot mapping (-1: padding).
    kv_c, k_pe, idx_k, slots = prompt(LAYERS, TOKENS, layout.num_slots)
    split = pcp.pcp_split(TOKENS, view.size)  # rank r owns chunks r and 2P-1-r of 2P
    me = view.local_index  # this rank's PCP rank
    batch = writer.prepare(split.local_slots(slots, me).to(buf.device))  # collective

    # Every layer: project K/V (here: take this rank's rows), write, then attention.
    for layer in range(LAYERS):
        rows = [split.local_rows(x[layer], me).to(buf.device) for x in (kv_c, k_pe, idx_k)]
        writer.write(layer, *rows, batch)  # my replica now holds every rank's rows
        cache = layout.main_kv(buf, layer), layout.indexer_k(buf, layer)  # what attention reads
        check(layout, cache, kv_c[layer], k_pe[layer], idx_k[layer], slots)
    writer.fence.fence()  # every member has written every layer (either route)
    for layer in range(LAYERS):  # so every replica holds the same bytes
        for peer in view.ranks:
            assert torch.equal(layout.layer_backing(buf, layer, peer).cpu(), layout.layer_backing(buf, layer).cpu())
    writer.fence.fence()  # nobody closes while a member still reads its replica
    buf.close()
    return f"rank {dist.get_rank()}: {LAYERS} layers x {TOKENS} tokens of {view.size} ranks in every replica: OK"
    # --8<-- [end:runtime]


# --8<-- [start:check]
def check(layout: pcp.CacheLayout, cache, kv_c, k_pe, idx_k, slots) -> None:
    """The oracle: each token's 656 + 132 bytes hold its values; untouched slots stay zero."""
    main, indexer = (t.cpu() for t in cache)
    rows = main.reshape(-1, 656)[slots]  # [tokens, 656]: fp8 kv_c | 4 fp32 scales | bf16 k_pe
    assert torch.equal(rows[:, 528:].view(torch.bfloat16), k_pe)  # RoPE part: copied exactly
    scales = rows[:, 512:528].view(torch.float32).repeat_interleave(128, dim=1)
    near(rows[:, :512].view(torch.float8_e4m3fn).float() * scales, kv_c.float(), scales)
    bs = layout.block_size  # indexer K, per block: bs x 128 fp8 values, then bs fp32 scales
    block, off = slots // bs, slots % bs
    values = torch.stack([indexer[b, o * 128 : o * 128 + 128] for b, o in zip(block, off)])
    scale = torch.stack([indexer[b, bs * 128 + o * 4 : bs * 128 + o * 4 + 4] for b, o in zip(block, off)])
    scale = scale.view(torch.float32)  # one power of two per token
    near(values.view(torch.float8_e4m3fn).float() * scale, idx_k.float(), scale)
    unused = torch.ones(layout.num_slots, dtype=torch.bool)
    unused[slots] = False
    assert not main.reshape(-1, 656)[unused].any()  # padding rows (slot -1) wrote nothing


def near(decoded: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of it, or by
    # 2^-10 of the scale for the smallest (subnormal) codes.
    assert ((decoded - x).abs() <= x.abs() / 16 + scale / 1024).all()
    # --8<-- [end:check]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 4: the PCP direct-KV writer")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--route", choices=pcp.ROUTES, default="direct")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's ranks, else 2 processes that run() starts
    lines = run(prefill, world, 1, args.backend, args.route, backend=args.backend)  # TP1 x PCP2
    if is_main_process():  # print once, also under torchrun
        print("\n".join(lines))
