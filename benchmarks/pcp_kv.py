"""Direct-KV publication against all-gather + insert: PCP2, PCP4 or TP×PCP.

Run on a machine with NVLinked GPUs (one process per GPU is spawned)::

    python benchmarks/pcp_kv.py [--world 2] [--tp 1] [--out benchmarks/results] [--tokens 1024 ... 32768]

``--world 4 --tp 1`` is PCP4; ``--world 4 --tp 2`` is TP2×PCP2: two PCP subgroups
({0, 2} and {1, 3}) publish concurrently on one buffer, each TP rank only inside its
own subgroup (rank = pcp_rank·tp + tp_rank).

For each number of tokens per rank, with DeepSeek-V3.2 shapes (kv_c 512, k_pe 64,
indexer K 128, bf16 in; fp8_ds_mla 656 B + indexer 132 B per token out) in the
default cache format (power-of-two main-KV scales, ue8m0 indexer scales) and a
61-layer prefill, it measures per layer, eagerly and in CUDA-graph replay:
  * direct: quantize + write into both replicas + one fence launch (``fused=False``);
  * fused: the same with the fence in the writer's tail (the writer's default);
  * allgather: NCCL all-gather of the bf16 inputs, then the insert kernel;
  * floors: the insert kernel writing only the local replica (no peers), and
    copy-engine peer copies of the bytes the writer sends to its PCP peers (one copy
    per peer, one after another on one stream);
  * host: the CPU time of an eager ``write()`` (the call alone, the GPU running behind);
  * at the largest size once more, the direct route in the legacy format (fp32 scales).
Medians of ``--reps`` runs of 61 layers. Prints a table with ratios and writes
``pcp_kv_<machine>[_<layout>].json`` and ``.png`` into ``--out`` (no suffix for PCP2).

``--shared`` measures ranks sharing one GPU under MPS (PCP over every rank, ``--pcp-tokens`` per
rank, ``--pcp-layers`` writes per timed call), the writer beside a floor kernel that stores the
same cache bytes into every replica without quantizing or fencing, and torch's ``index_copy_``
of those bytes (the floor rule of ``benchmarks/shared.py`` picks the floor; writes
``pcp_kv_<machine>_mps.json``; ``--host-smoke`` runs it on the host backend)::

    python benchmarks/pcp_kv.py --shared --worlds 2,4,8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LAYERS = 61


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    dev = common.init_worker(rank, world, 29532)
    import symmsync as ss
    from symmsync import pcp

    layers = args.layers
    tp, p = args.tp, world // args.tp
    widths = (pcp.MainKVLayout.NOPE_DIM, pcp.MainKVLayout.ROPE_DIM, pcp.IndexerKLayout.DIM)  # 512, 64, 128
    token_bytes = pcp.MainKVLayout.TOKEN_BYTES + pcp.IndexerKLayout.TOKEN_BYTES  # 656 + 132
    group = common.pcp_group(world, tp) if tp > 1 else None
    config = sweep(rank, world, args) if args.sweep else {}
    results = []
    for tokens in args.tokens:  # tokens per rank
        total = tokens * p
        layout = pcp.CacheLayout(num_blocks=total // 64 + 1, num_layers=layers, base=0)
        buf = ss.SymmetricBuffer(layout.end, backend="cuda", channels=4)
        view = ss.pcp_view(buf, tp=tp)
        me = view.local_index
        split = pcp.pcp_split(total, p)
        slots = split.local_slots(torch.arange(total), me).to(dev)
        g = torch.Generator(device=dev).manual_seed(rank)
        inputs = [torch.randn(split.tokens_per_rank, w, device=dev, generator=g).to(torch.bfloat16) for w in widths]
        row = {"tokens_per_rank": tokens, "layers": layers}
        writers = {
            "direct": pcp.DirectKVWriter(view, layout, route="direct", fused=False, channel=0, **config),
            "fused": pcp.DirectKVWriter(view, layout, route="direct", fused=True, channel=1, **config),
            "allgather": pcp.DirectKVWriter(view, layout, route="allgather", group=group, **config),
        }
        for name, w in writers.items():
            batch = w.prepare(slots)

            def prefill(w=w, batch=batch):
                for layer in range(layers):
                    w.write(layer, *inputs, batch)  # noqa: B023 - called within this iteration

            row[f"{name}.eager"] = common.eager_us(prefill, iters=1, reps=args.reps, warmup=2) / layers
            row[f"{name}.graph"] = common.graph_us(prefill, iters=1, reps=args.reps) / layers
            row[f"{name}.host"] = common.eager_us(prefill, iters=1, reps=args.reps, warmup=3, host_only=True) / layers
        if tokens == max(args.tokens):  # the legacy format (vLLM <= 0.11), once
            legacy = pcp.CacheLayout(layout.num_blocks, layers, main_scale="fp32", indexer_scale="fp32")
            w = pcp.DirectKVWriter(view, legacy, route="direct", fused=False, channel=2, **config)
            batch = w.prepare(slots)

            def prefill(w=w, batch=batch):
                for layer in range(layers):
                    w.write(layer, *inputs, batch)  # noqa: B023 - called within this iteration

            row["direct_legacy.eager"] = common.eager_us(prefill, iters=1, reps=args.reps, warmup=2) / layers
            row["direct_legacy.graph"] = common.graph_us(prefill, iters=1, reps=args.reps) / layers
            writers["legacy"] = w
        # Floors. The insert kernel into the local replica only (the allgather route's
        # kernel on this rank's rows), and the copy engine moving the peer's share.
        local = writers["allgather"]
        lbatch = pcp.Batch(slots=slots, rows=slots.numel(), writer=local)
        lbatch._grid = local._grid_for(lbatch.rows)

        def local_insert():
            for layer in range(layers):
                local._launch(layer, *inputs, *widths, lbatch.slots, lbatch.rows, lbatch)  # noqa: B023

        row["local_insert.eager"] = common.eager_us(local_insert, iters=1, reps=args.reps, warmup=2) / layers
        row["local_insert.graph"] = common.graph_us(local_insert, iters=1, reps=args.reps) / layers
        nbytes = split.tokens_per_rank * token_bytes
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        peers = [view.tensor(0, (nbytes,), torch.uint8, index=i) for i in range(p) if i != me]

        def ce_copies():
            for t in peers:  # noqa: B023 - called within this iteration
                t.copy_(src)  # noqa: B023

        row["ce_peer_copy.eager"] = common.eager_us(ce_copies, iters=layers, reps=args.reps)
        row["peer_bytes_per_layer"] = nbytes * (p - 1)
        results.append(row)
        for w in writers.values():
            w.fence.synchronize()
        dist.barrier()
        buf.close()
        torch.cuda.empty_cache()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rows": results, "config": config, "sweep": SWEEP_RESULTS})
    if rank == 0:
        report(gathered, args)
    dist.barrier()
    dist.destroy_process_group()


def layout_name(world: int, tp: int) -> str:
    p = world // tp
    return f"PCP{p}" if tp == 1 else f"TP{tp}×PCP{p}"


CONFIGS = [  # symmsync.pcp.Tuning fields
    {},
    {"block_rows": 8, "num_warps": 2},
    {"block_rows": 32, "num_warps": 8},
    {"block_rows": 16, "num_warps": 4, "programs_per_sm": 4},
    {"spread": True},
    {"block_rows": 8, "num_warps": 2, "spread": True},
]
SWEEP_RESULTS: list = []


def sweep(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Writer kernel configurations at the largest size (direct, graph replay); the fastest is used."""
    import symmsync as ss
    from symmsync import pcp

    tokens = max(args.tokens)
    p = world // args.tp
    total = tokens * p
    dev = torch.device("cuda", rank)
    layers = 8
    layout = pcp.CacheLayout(num_blocks=total // 64 + 1, num_layers=layers, base=0)
    buf = ss.SymmetricBuffer(layout.end, backend="cuda", channels=len(CONFIGS))
    view = ss.pcp_view(buf, tp=args.tp)
    split = pcp.pcp_split(total, p)
    slots = split.local_slots(torch.arange(total), view.local_index).to(dev)
    inputs = [torch.randn(split.tokens_per_rank, w, device=dev).to(torch.bfloat16) for w in (512, 64, 128)]
    times = []
    for i, cfg in enumerate(CONFIGS):
        w = pcp.DirectKVWriter(view, layout, route="direct", fused=False, channel=i, **cfg)
        batch = w.prepare(slots)

        def prefill(w=w, batch=batch):
            for layer in range(layers):
                w.write(layer, *inputs, batch)

        t = common.graph_us(prefill, iters=1, reps=args.reps) / layers
        times.append(t)
        SWEEP_RESULTS.append({"config": cfg, "tokens_per_rank": tokens, "direct_graph_us": t})
    # Every rank must pick the same configuration: the slowest rank's times decide.
    gathered: list = [None] * world
    dist.all_gather_object(gathered, times)
    worst = [max(g[i] for g in gathered) for i in range(len(CONFIGS))]
    best = CONFIGS[worst.index(min(worst))]
    buf.close()
    torch.cuda.empty_cache()
    return dict(best)


def report(per_rank: list, args: argparse.Namespace) -> None:
    info = common.machine()
    config, sweep_rows = per_rank[0]["config"], per_rank[0]["sweep"]
    per_rank = [p["rows"] for p in per_rank]
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        row = dict(r0)
        for k, _v in r0.items():
            if k.endswith((".eager", ".graph")):
                row[k] = max(r[i][k] for r in per_rank)  # the slower rank sets the pace
        rows.append(row)
    lines = []
    if sweep_rows:
        lines.append(
            f"writer configurations at {sweep_rows[0]['tokens_per_rank']} tokens/rank, direct, graph replay "
            "(rank 0, µs per layer):"
        )
        lines += [f"  {r['config']}: {r['direct_graph_us']:.1f}" for r in sweep_rows]
    lines.append(f"writer configuration used below: {config or 'the defaults'}")
    lines += [
        f"{layout_name(args.world, args.tp)} KV publication, µs per layer (median of {args.reps} runs of a "
        f"{args.layers}-layer prefill); "
        f"{info['gpu_count']}× {info['gpus'][0]}, torch {info['torch']}, triton {info['triton']}",
        f"{'tokens/rank':>11s} {'mode':>5s} {'direct':>8s} {'fused':>8s} {'allgath':>8s} {'local':>8s} "
        f"{'CE peers':>8s} {'speedup':>8s} {'writer GB/s':>11s} {'CE GB/s':>8s} {'% of CE':>7s}",
        "(GB/s: bytes this rank sends to all its PCP peers per layer, over the time of one layer)",
    ]
    for row in rows:
        ce = row["ce_peer_copy.eager"]
        for mode in ("graph", "eager"):
            d, f, a = row[f"direct.{mode}"], row[f"fused.{mode}"], row[f"allgather.{mode}"]
            loc = row[f"local_insert.{mode}"]
            bw = row["peer_bytes_per_layer"] / d / 1e3
            ce_bw = row["peer_bytes_per_layer"] / ce / 1e3
            row[f"speedup.{mode}"] = a / d
            row[f"writer_peer_GBps.{mode}"] = bw
            row["ce_peer_GBps"] = ce_bw
            lines.append(
                f"{row['tokens_per_rank']:>11d} {mode:>5s} {d:8.1f} {f:8.1f} {a:8.1f} {loc:8.1f} {ce:8.1f} "
                f"{a / d:7.2f}× {bw:11.1f} {ce_bw:8.1f} {bw / ce_bw:7.1%}"
            )
    lines.append(
        "host µs per eager write(): "
        + "; ".join(
            f"{r['tokens_per_rank']}: direct {r['direct.host']:.1f}, fused {r['fused.host']:.1f}, "
            f"allgather {r['allgather.host']:.1f}"
            for r in rows
        )
    )
    for r in rows:
        if "direct_legacy.graph" in r:
            lines.append(
                f"legacy format (fp32 scales) at {r['tokens_per_rank']} tokens/rank, direct: "
                f"graph {r['direct_legacy.graph']:.1f} µs, eager {r['direct_legacy.eager']:.1f} µs "
                f"(default format: {r['direct.graph']:.1f}, {r['direct.eager']:.1f})"
            )
    lines.append(
        "targets: local insert <= 25 µs at 32k (graph); writer >= 90% of copy-engine bandwidth at >= 16k "
        "(graph); eager <= 1.15× graph (direct, fused) at >= 4k, <= graph + 8 µs at 1k; "
        "direct >= 3× allgather at >= 4k"
    )
    for row in rows:
        t = row["tokens_per_rank"]
        if t >= 32768:
            loc = row["local_insert.graph"]
            lines.append(f"  {t:>6d} graph: local insert {loc:.1f} µs ({'met' if loc <= 25 else 'MISSED'})")
        for mode in ("graph", "eager"):
            notes = []
            if t >= 4096:
                sp = row[f"speedup.{mode}"]
                notes.append(f"speedup {sp:.2f}× ({'met' if sp >= 3 else 'MISSED'})")
            if t >= 16384 and mode == "graph":
                frac = row[f"writer_peer_GBps.{mode}"] / row["ce_peer_GBps"]
                notes.append(f"bandwidth {frac:.0%} of CE ({'met' if frac >= 0.9 else 'MISSED'})")
            if mode == "eager":
                for name in ("direct", "fused"):
                    e, g = row[f"{name}.eager"], row[f"{name}.graph"]
                    ok = e <= 1.15 * g if t >= 4096 else e <= g + 8
                    notes.append(f"{name} eager {e:.1f} vs graph {g:.1f} µs ({'met' if ok else 'MISSED'})")
            if notes:
                lines.append(f"  {t:>6d} {mode}: " + "; ".join(notes))
    text = "\n".join(lines)
    print(text, flush=True)
    name = f"pcp_kv_{common.slug(info)}"
    if (args.world, args.tp) != (2, 1):
        name += f"_{layout_name(args.world, args.tp).lower().replace('×', 'x')}"
    common.write_json(
        os.path.join(args.out, name + ".json"),
        {
            "machine": info,
            "world": args.world,
            "tp": args.tp,
            "pcp": args.world // args.tp,
            "rows": rows,
            "per_rank": per_rank,
            "reps": args.reps,
            "table": text,
            "writer_config": config,
            "sweep": sweep_rows,
        },
    )
    plot(rows, info, os.path.join(args.out, name + ".png"), layout_name(args.world, args.tp))
    print(f"wrote {os.path.join(args.out, name)}.json and .png", flush=True)


def plot(rows: list, info: dict, path: str, label: str = "PCP2") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["tokens_per_rank"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (
        ("direct", "direct (writer + fence)"),
        ("fused", "direct, fused tail"),
        ("allgather", "all-gather + insert"),
        ("local_insert", "local insert (floor)"),
    ):
        ax.plot(t, [r[f"{key}.graph"] for r in rows], marker="o", label=label)
    ax.plot(t, [r["ce_peer_copy.eager"] for r in rows], marker="x", ls="--", label="copy-engine peer copies")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("µs per layer (graph replay)")
    ax.legend(fontsize=8)
    bx.plot(t, [r["writer_peer_GBps.graph"] for r in rows], marker="o", label="writer peer writes")
    bx.plot(t, [r["ce_peer_GBps"] for r in rows], marker="x", ls="--", label="copy engine")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("tokens per rank")
    bx.set_ylabel("GB/s to the PCP peers")
    bx.legend(fontsize=8)
    fig.suptitle(
        f"{label} KV publication, {info['gpu_count']}× {info['gpus'][0]}, torch {info['torch']}, "
        f"triton {info['triton']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def shared_rank(ctx) -> None:
    """Ranks sharing one GPU under MPS (``benchmarks/shared.py``): the direct writer beside its floor.

    The floor stores into the same cache regions of the same buffer (cache bytes only: no fence
    cell, no header), through the writer's destination table (``view.ptrs``), on the writer's grid."""
    import floors
    import triton

    import symmsync as ss
    from symmsync import pcp

    w, dev = ctx.world, ctx.device
    tokens, layers = ctx.settings["pcp_tokens"], ctx.settings["pcp_layers"]
    if ctx.backend == "host":  # --host-smoke: Triton's interpreter, small
        tokens, layers = 64, 2
    total = tokens * w
    layout = pcp.CacheLayout(num_blocks=total // 64 + 1, num_layers=layers, base=0)
    buf = ss.SymmetricBuffer(layout.end, backend=ctx.backend, channels=4)
    try:
        view = buf.view(list(range(w)))
        me = view.local_index
        split = pcp.pcp_split(total, w)
        slots = split.local_slots(torch.arange(total), me).to(dev)
        g = torch.Generator(device=dev).manual_seed(ctx.rank)
        widths = (pcp.MainKVLayout.NOPE_DIM, pcp.MainKVLayout.ROPE_DIM, pcp.IndexerKLayout.DIM)
        inputs = [torch.randn(split.tokens_per_rank, c, device=dev, generator=g).to(torch.bfloat16) for c in widths]
        token_bytes = pcp.MainKVLayout.TOKEN_BYTES + pcp.IndexerKLayout.TOKEN_BYTES
        placement = layout.placement(buf)
        rows = slots.numel()
        direct = pcp.DirectKVWriter(view, layout, route="direct", fused=False, channel=0, timeout_s=ctx.wait_s)
        fused = pcp.DirectKVWriter(view, layout, route="direct", fused=True, channel=1, timeout_s=ctx.wait_s)
        block_rows = direct.tuning.block_rows
        per_sm = direct.tuning.programs_per_sm
        items = triton.cdiv(rows, block_rows)
        grid = (max(1, min(items, ctx.sms * per_sm) if per_sm else items),)
        ptrs = view.ptrs

        def floor_layer(layer: int) -> None:
            main_off, idx_off = placement.offsets[layer]
            floors.kv_store_floor[grid](*inputs, slots, rows, ptrs, main_off, idx_off, placement.main_block_stride,
                                        placement.indexer_block_stride, NDST=w, BLOCK_T=block_rows,
                                        BLOCK_SIZE=layout.block_size, num_warps=direct.tuning.num_warps)  # fmt: skip

        def floor() -> None:
            for layer in range(layers):
                floor_layer(layer)

        def check():
            # k_pe's 128 bytes are copied bit for bit by both: the writer's layer 0 and the floor's
            # layer 1 must hold the same ones at every slot of every member's tokens.
            batch = direct.prepare(slots)
            direct.write(0, *inputs, batch)
            floor_layer(1)
            ctx.barrier()
            a = layout.main_kv(buf, 0).view(-1, pcp.MainKVLayout.TOKEN_BYTES)[:total, 528:]
            b = layout.main_kv(buf, 1).view(-1, pcp.MainKVLayout.TOKEN_BYTES)[:total, 528:]
            return True if torch.equal(a, b) else "k_pe bytes differ from the writer's"

        # torch's kernel for the same bytes: each layer's 788 cache bytes a token (as int32 words) copied
        # into a local stand-in of every replica at its slot, one index_copy_ a layer.
        n_slots, words = layout.num_blocks * layout.block_size, token_bytes // 4
        cache = torch.empty(w * n_slots, words, dtype=torch.int32, device=dev)
        to = torch.cat([slots + r * n_slots for r in range(w)])
        words_in = torch.randint(-(2**30), 2**30, (w * rows, words), dtype=torch.int32, device=dev)

        def torch_floor() -> None:
            for _ in range(layers):
                cache.index_copy_(0, to, words_in)

        moves = (
            f"{split.tokens_per_rank} tokens' bf16 rows read ({2 * sum(widths)} B each), their {token_bytes} cache "
            f"bytes (656 + 132) stored into each of the {w} replicas: "
            f"{split.tokens_per_rank * token_bytes * w / 2**20:.1f} MiB a layer"
        )
        for name, writer in (("direct (fused=False: writer + fence launch)", direct), ("direct, fused fence", fused)):
            batch = writer.prepare(slots)

            def prefill(writer=writer, batch=batch):
                for layer in range(layers):
                    writer.write(layer, *inputs, batch)

            ctx.figure(
                f"PCP{w} {name}, {tokens} tok/rank, per layer",
                prefill,
                floor,
                "kv_store_floor (no quantization, no fence)",
                moves,
                iters=max(5, ctx.iters // 20),
                calls=layers,
                check=check if writer is direct else None,
                torch_floor={"index_copy_ of the cache bytes into every replica": torch_floor},
                bytes_moved=rows * 2 * sum(widths) + rows * token_bytes * w,
                tags={"what": "pcp_writer", "fused": writer is fused},
            )
    finally:
        ctx.barrier()
        buf.close()


def main() -> None:
    if "--shared" in sys.argv[1:]:
        import shared

        sys.exit(shared.main(sys.argv[1:], bench="pcp_kv"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--layers", type=int, default=LAYERS)
    common.add_layout_args(parser)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--no-sweep",
        dest="sweep",
        action="store_false",
        help="skip the writer-configuration sweep; use the writer's defaults",
    )
    common.spawn(worker, parser.parse_args(), "benchmarks/pcp_kv.py")


if __name__ == "__main__":
    main()
