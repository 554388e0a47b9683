"""MoE dispatch and combine: symmsync.moe against torch.distributed.all_to_all_single (NCCL).

Run on a machine with 2 or more NVLinked GPUs (one process per GPU is spawned)::

    python benchmarks/moe.py [--world 8] [--out benchmarks/results] [--reps 7] [--experts 256]

Measures, in one run on the same GPUs, at 1 to 256 tokens per member, hidden 7168, top-8,
bfloat16 and fp8 (e4m3 with per-128-channel scales), medians of ``--reps`` runs of the time per
call, eagerly and in CUDA-graph replay:
  * ``Dispatcher.dispatch`` and ``Dispatcher.combine`` (``max_tokens`` 256);
  * NCCL's ``all_to_all_single`` of the same bytes a dispatch moves when the routing is even
    (``tokens * top_k`` rows of ``hidden`` bf16, split evenly over the members; fp8: the codes and
    scales), the baseline a runtime without symmetric memory uses for each of the two steps.
Prints a table of µs and ratios with the issue's targets (dispatch at most 40 µs and combine at
most 50 µs at 128 tokens per member over 8 GPUs; 3x all_to_all_single up to 256 tokens), and
writes ``moe_<machine>.json`` and ``.png`` into ``--out``. Refuses on fewer than 2 GPUs. A
benchmark, never a timed test.

``--smoke`` runs the same calls on the host backend (2 processes, Triton's interpreter, small
sizes, no NCCL), checks that they run and writes ``moe_host_smoke.json`` into ``--out``: what
CI runs (tests/moe/test_moe_benchmark.py). Its times are the interpreter's, no GPU figure.

``--shared`` measures ranks sharing one GPU under MPS (``benchmarks/moe_shared.py`` says what:
1, 32, 128 and 256 tokens a rank, 8 experts a rank, bf16 and fp8, each step beside its floor
kernels and torch's kernels for the same rows, the run's copy bandwidth, a fence, the host
cost, a Mixtral-like layer with and without the transfer, the ``programs`` sweep), and
``moe_targets.py`` judges the targets; writes ``moe_<machine>_mps.json`` and ``.png``
(``benchmarks/shared.py``; ``--dry-run`` from made-up numbers, no GPU)::

    python benchmarks/moe.py --shared --worlds 2,4,8 --budget-s 330
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HIDDEN, TOP_K, MAX_TOKENS = 7168, 8, 256


def routing(
    tokens: int, num_experts: int, seed: int, device, top_k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(topk_idx, weights, generator)``: each token's ``top_k`` (default :data:`TOP_K`) distinct experts at random."""
    k = top_k or TOP_K
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]) if tokens else None
    ids = ids if ids is not None else torch.empty(0, k, dtype=torch.int64)
    w = torch.rand(tokens, k, generator=g)
    return ids.to(torch.int64).to(device), w.to(device), g


def measure(disp, tokens: int, hidden: int, seed: int, timer) -> dict:
    """µs per dispatch and per combine with ``timer(fn)``; the combine after a dispatch of the same routing."""
    dev = disp.view.buffer.device
    ids, w, g = routing(tokens, disp.num_experts, seed, dev)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
    recv, counts, handle = disp.dispatch(x, ids)
    shape = (disp.local_experts, disp.size * disp.max_tokens, hidden)
    out = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
    d = timer(lambda: disp.dispatch(x, ids))
    recv, counts, handle = disp.dispatch(x, ids)  # a combine takes a handle of the last two dispatches
    return {"dispatch": d, "combine": timer(lambda: disp.combine(out, w, handle))}


# ---------------------------------------------------------------------- the host-backend smoke run
def _smoke_rank(tokens_list, hidden, num_experts, top_k, calls):
    import symmsync as ss
    from symmsync import moe

    global TOP_K
    TOP_K = top_k
    world = dist.get_world_size()
    res = {}
    for fp8 in (False, True):
        buf = ss.SymmetricBuffer(moe.buffer_bytes(num_experts, max(tokens_list), hidden, torch.bfloat16, top_k, world,
                                                  fp8=fp8))  # fmt: skip
        disp = moe.Dispatcher(buf.view(list(range(world))), num_experts, max(tokens_list), hidden, torch.bfloat16,
                              top_k, fp8=fp8)  # fmt: skip

        def timer(fn):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - t0) / calls * 1e6

        for t in tokens_list:
            res[f"{'fp8' if fp8 else 'bf16'}/{t}"] = measure(disp, t, hidden, t, timer)
        buf.close()
    import moe_layer

    # the Mixtral-like layer of --shared, small and float32: waited, wait=False, and without the transfer
    layer = moe_layer.smoke_rank(hidden, 64, num_experts, top_k, max(tokens_list))
    return {"us": res, "layer": layer}


def smoke(out: str) -> None:
    from common import machine, write_json

    from symmsync.testing import run

    tokens, hidden, experts, top_k = (1, 4), 256, 4, 2
    both = run(_smoke_rank, 2, tokens, hidden, experts, top_k, 2, timeout_s=600)
    results, layers = [r["us"] for r in both], [r["layer"] for r in both]
    rows = results[0]
    print(f"{'case':>10} {'dispatch us':>12} {'combine us':>12}   (host backend, Triton's interpreter: no GPU figure)")
    for case, r in rows.items():
        print(f"{case:>10} {r['dispatch']:12.0f} {r['combine']:12.0f}")
    payload = {
        "what": "benchmarks/moe.py --smoke: the calls run on the host backend (2 processes, interpreter)",
        "sizes": {"tokens": list(tokens), "hidden": hidden, "experts": experts, "top_k": top_k, "world": 2},
        "machine": machine(),
        "us_per_call": results,
        "layer": layers,
    }
    path = os.path.join(out, "moe_host_smoke.json")
    write_json(path, payload)
    print(f"wrote {path}")
    for rank, layer in enumerate(layers):
        print(f"rank {rank}: Mixtral-like layer (waited, wait=False, without the transfer): check {layer['check']}")
    if any(layer["check"] is not True for layer in layers):
        sys.exit("benchmarks/moe.py --smoke: the Mixtral-like layer failed its check")


# ---------------------------------------------------------------------- the GPU run
def _gpu_rank(rank: int, world: int, args) -> None:
    from common import eager_us, graph_us, init_worker, machine, slug, sync_all, write_json

    import symmsync as ss
    from symmsync import moe

    dev = init_worker(rank, world, args.port)
    res = {}
    for fp8 in (False, True):
        kind = "fp8" if fp8 else "bf16"
        buf = ss.SymmetricBuffer(moe.buffer_bytes(args.experts, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K, world,
                                                  fp8=fp8), backend="cuda")  # fmt: skip
        disp = moe.Dispatcher(buf.view(list(range(world))), args.experts, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K,
                              fp8=fp8)  # fmt: skip
        for t in TOKENS:
            row = {
                "eager": measure(disp, t, HIDDEN, t, lambda fn: eager_us(fn, 50, args.reps)),
                "graph": measure(disp, t, HIDDEN, t, lambda fn: graph_us(fn, 50, args.reps)),
            }
            row_bytes = HIDDEN + HIDDEN // 128 * 4 if fp8 else HIDDEN * 2
            per_peer = -(-t * TOP_K // world) * row_bytes
            inp = torch.empty(world * per_peer, dtype=torch.uint8, device=dev)
            outp = torch.empty_like(inp)
            a2a = lambda o=outp, i=inp: dist.all_to_all_single(o, i)  # noqa: E731
            row["nccl_all_to_all_single"] = {
                "eager": eager_us(a2a, 50, args.reps),
                "graph": graph_us(a2a, 50, args.reps),
            }
            res[f"{kind}/{t}"] = row
        sync_all()
        buf.close()
    if rank == 0:
        info = machine()
        name = f"moe_{slug(info)}"
        print(f"{'case':>10} {'dispatch':>9} {'combine':>9} {'a2a':>9} {'disp x':>7}   (µs, graph replay)")
        for case, r in res.items():
            g, a = r["graph"], r["nccl_all_to_all_single"]["graph"]
            print(f"{case:>10} {g['dispatch']:9.1f} {g['combine']:9.1f} {a:9.1f} {a / g['dispatch']:7.2f}")
        print("targets: dispatch <= 40 us, combine <= 50 us at 128 tokens, EP8; >= 3x all_to_all_single up to 256")
        write_json(os.path.join(args.out, name + ".json"), {"machine": info, "world": world, "us": res})
        plot(res, os.path.join(args.out, name + ".png"), world)
        print(f"wrote {os.path.join(args.out, name)}.json and .png", flush=True)
    dist.destroy_process_group()


def plot(res: dict, path: str, world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in ("bf16", "fp8"):
        for step in ("dispatch", "combine"):
            ax.plot(TOKENS, [res[f"{kind}/{t}"]["graph"][step] for t in TOKENS], marker="o", label=f"{step} {kind}")
        ax.plot(TOKENS, [res[f"{kind}/{t}"]["nccl_all_to_all_single"]["graph"] for t in TOKENS], "--",
                label=f"all_to_all_single {kind}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per member")
    ax.set_ylabel("µs per call (graph replay)")
    ax.set_title(f"MoE dispatch/combine, EP{world}, hidden {HIDDEN}, top-{TOP_K}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------- ranks sharing one GPU (MPS)
def shared_rank(ctx) -> None:
    """Ranks sharing one GPU under MPS (``benchmarks/shared.py``): ``moe_shared.py`` measures."""
    import moe_shared

    moe_shared.shared_rank(ctx)


def main() -> None:
    if "--shared" in sys.argv[1:]:
        import shared

        sys.exit(shared.main(sys.argv[1:], bench="moe"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="GPUs (one process each)")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--port", type=int, default=29571)
    parser.add_argument("--smoke", action="store_true", help="the host-backend smoke run (CI), no GPU")
    args = parser.parse_args()
    if args.smoke:
        smoke(args.out)
        return
    n = torch.cuda.device_count()
    if args.world < 2 or n < args.world:
        sys.exit(f"benchmarks/moe.py --world {args.world} needs {args.world} GPUs (at least 2); this machine has {n}")
    import torch.multiprocessing as mp

    mp.spawn(_gpu_rank, args=(args.world, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
