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

``--shared`` measures ranks sharing one GPU under MPS (1, 32, 128 and 256 tokens a rank, 8 experts a rank,
bf16 and fp8), each step beside a floor kernel that moves its bytes without synchronization
(``benchmarks/shared.py``; writes ``moe_<machine>_mps.json``); then, bf16 at 128 tokens in graph
replay, the same calls with the dispatcher's ``programs`` at 4, 8 and 16 a multiprocessor (the
default is 2)::

    python benchmarks/moe.py --shared --worlds 2,4,8
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


def routing(tokens: int, num_experts: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOP_K] for _ in range(tokens)]) if tokens else None
    ids = ids if ids is not None else torch.empty(0, TOP_K, dtype=torch.int64)
    w = torch.rand(tokens, TOP_K, generator=g)
    return ids.to(torch.int64).to(device), w.to(device), g


def measure(disp, tokens: int, hidden: int, seed: int, timer) -> dict:
    """µs per dispatch and per combine with ``timer(fn)``; the combine after a dispatch of the same routing."""
    dev = disp.view.buffer.device
    ids, w, g = routing(tokens, disp.num_experts, seed, dev)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
    recv, counts, handle = disp.dispatch(x, ids)
    shape = (disp.local_experts, disp.size * disp.max_tokens, hidden)
    out = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
    return {"dispatch": timer(lambda: disp.dispatch(x, ids)), "combine": timer(lambda: disp.combine(out, w, handle))}


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
    return res


def smoke(out: str) -> None:
    from common import machine, write_json

    from symmsync.testing import run

    tokens, hidden, experts, top_k = (1, 4), 256, 4, 2
    results = run(_smoke_rank, 2, tokens, hidden, experts, top_k, 2, timeout_s=600)
    rows = results[0]
    print(f"{'case':>10} {'dispatch us':>12} {'combine us':>12}   (host backend, Triton's interpreter: no GPU figure)")
    for case, r in rows.items():
        print(f"{case:>10} {r['dispatch']:12.0f} {r['combine']:12.0f}")
    payload = {
        "what": "benchmarks/moe.py --smoke: the calls run on the host backend (2 processes, interpreter)",
        "sizes": {"tokens": list(tokens), "hidden": hidden, "experts": experts, "top_k": top_k, "world": 2},
        "machine": machine(),
        "us_per_call": results,
    }
    path = os.path.join(out, "moe_host_smoke.json")
    write_json(path, payload)
    print(f"wrote {path}")


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
SHARED_TOKENS, SHARED_MAX_TOKENS, SHARED_EXPERTS_PER_RANK = (1, 32, 128, 256), 256, 8
SHARED_MODES = ("graph", "eager")
# The dispatcher's programs a launch sized by the device (its ``programs`` argument), per multiprocessor
# the device reports: the default (2) runs every row; these run too, bf16 at 128 tokens in graph replay.
SHARED_PROGRAMS_PER_SM = (4, 8, 16)


def shared_rank(ctx) -> None:
    """Ranks sharing one GPU under MPS (``benchmarks/shared.py``): dispatch and combine beside their floors.

    For bf16 and fp8 rows, at 1, 32, 128 and 256 tokens a rank (``max_tokens`` 256), in CUDA-graph
    replay and eagerly. The floors run in a second buffer of the same size at the dispatcher's
    workspace offsets, with the placement the dispatcher's rule gives
    (:func:`floors.moe_placement`) and the counts and source indices of a real dispatch (its
    handle), so that they store the rows where the dispatcher does."""
    for fp8 in (False, True):
        _shared_kind(ctx, fp8)


def _shared_kind(ctx, fp8: bool) -> None:
    """:func:`shared_rank` for one kind of row (bf16, or fp8 codes and scales): one dispatcher, every
    token count and mode."""
    import symmsync as ss
    from symmsync import moe

    w, bf16 = ctx.world, torch.bfloat16
    E, M = SHARED_EXPERTS_PER_RANK * w, SHARED_MAX_TOKENS
    nbytes = moe.buffer_bytes(E, M, HIDDEN, bf16, TOP_K, w, fp8=fp8)
    buf = ss.SymmetricBuffer(nbytes, backend="cuda")
    fbuf = ss.SymmetricBuffer(nbytes, backend="cuda")
    try:
        view, fview = buf.view(list(range(w))), fbuf.view(list(range(w)))
        disp = moe.Dispatcher(view, E, M, HIDDEN, bf16, TOP_K, fp8=fp8, timeout_s=ctx.wait_s)
        # What the floors write and the combine reads, the same size at every token count: made once.
        EL, G, dev = SHARED_EXPERTS_PER_RANK, HIDDEN // 128, ctx.device
        out = {
            "frecv": torch.empty((EL, w * M, HIDDEN), dtype=torch.uint8 if fp8 else bf16, device=dev),
            "fscales": torch.empty((EL, w * M, G), dtype=torch.float32, device=dev),
            "fsrc": torch.empty((EL, w * M), dtype=torch.int64, device=dev),
            "expert_out": torch.randn((EL, w * M, HIDDEN), device=dev).to(bf16),
        }
        for tokens in SHARED_TOKENS:
            for mode in SHARED_MODES:
                _shared_figures(ctx, disp, fview, fp8, tokens, mode, **out)
        for per_sm in () if fp8 else SHARED_PROGRAMS_PER_SM:  # the same calls, their launches sized otherwise
            disp.close()
            disp = moe.Dispatcher(view, E, M, HIDDEN, bf16, TOP_K, timeout_s=ctx.wait_s, programs=per_sm * ctx.sms)
            _shared_figures(ctx, disp, fview, fp8, 128, "graph", label=f", {per_sm} programs/SM", **out)
    finally:
        ctx.barrier()
        buf.close()
        fbuf.close()


def _shared_figures(
    ctx, disp, fview, fp8: bool, T: int, mode: str, *, frecv, fscales, fsrc, expert_out, label: str = ""
) -> None:
    """The dispatch and combine figures of ``T`` tokens a rank in ``mode``, each beside its floor
    (``frecv``, ``fscales``, ``fsrc``: where the dispatch floor writes; ``expert_out``: what both
    combines read; ``label``: after the figure's mode in its name)."""
    import floors
    import triton

    w, dev, bf16 = ctx.world, ctx.device, torch.bfloat16
    H, K, EL, M = HIDDEN, TOP_K, SHARED_EXPERTS_PER_RANK, disp.max_tokens
    HP, G = triton.next_power_of_2(H), H // 128
    GP = triton.next_power_of_2(G)
    kind = "fp8" if fp8 else "bf16"
    ws, fptrs = disp.workspace, fview.ptrs
    ids, weights, g = routing(T, disp.num_experts, 1000 + 7 * T + ctx.rank, dev)
    x = torch.randn(T, H, generator=g).to(bf16).to(dev)
    with torch.no_grad():
        recv, counts, handle = disp.dispatch(x, ids)
    torch.cuda.synchronize()
    member, row = floors.moe_placement(ids, EL, w, fview.local_index, M)
    per_source, offsets = handle.per_source, handle.offsets

    def floor_dispatch() -> None:
        floors.moe_send_floor[(T,)](x, member, row, fptrs, ws.rows, ws.scales, ws.src,
                                    TOPK=K, H=H, HP=HP, FP8=fp8, G=G, GP=GP)  # fmt: skip
        floors.moe_read_floor[(EL * w,)](frecv, fscales, fsrc, per_source, offsets, fptrs, fview.local_index,
                                         ws.rows, ws.scales, ws.src, SIZE=w, M=M, H=H, HP=HP, FP8=fp8,
                                         G=G, GP=GP)  # fmt: skip

    def dispatch_check():
        ctx.barrier()
        for _ in range(2):  # every member's rows in place before the read of the second round
            floor_dispatch()
            ctx.barrier()
        for e, n in enumerate(counts.tolist()):  # the received rows, packed: past the counts, nothing
            if not torch.equal(fsrc[e, :n], handle.src[e, :n]):
                return "source indices differ from the dispatcher's"
            if not fp8 and not torch.equal(frecv[e, :n].view(torch.int16), recv[e, :n].view(torch.int16)):
                return "received rows differ from the dispatcher's"
        return True

    sent = int((member >= 0).sum())
    rows_idx = torch.randint(0, T, (T * K,), device=dev)
    row_bytes = H + 4 * G if fp8 else 2 * H
    what = f"{T} tok, {H}, top-{K}, {EL} exp/rank, {mode}{label}"
    ctx.figure(
        f"MoE dispatch {kind} ({what})",
        lambda: disp.dispatch(x, ids),
        floor_dispatch,
        "moe_send_floor + moe_read_floor",
        f"{sent} rows of {row_bytes} B stored into the owners' rows (+ 8 B source index each), then "
        "the rows this rank received written out to their packed places (as the dispatcher's read)",
        mode=mode,
        iters=max(20, ctx.iters // 4),
        more={f"torch index_select of {T * K} rows (local)": lambda: x.index_select(0, rows_idx)},
        check=dispatch_check,
    )
    fy = torch.empty(T, H, dtype=bf16, device=dev)

    def floor_combine() -> None:
        floors.moe_return_floor[(EL * w,)](expert_out, handle.src, per_source, offsets, fptrs, ws.combine,
                                           SIZE=w, M=M, H=H, HP=HP)  # fmt: skip
        floors.moe_sum_floor[(T,)](fy, weights, fptrs, fview.local_index, ws.combine, TOPK=K, H=H, HP=HP,
                                   enable_fp_fusion=False)  # fmt: skip

    def combine_check():
        with torch.no_grad():
            want = disp.combine(expert_out, weights, handle)
        ctx.barrier()
        for _ in range(2):
            floor_combine()
            ctx.barrier()
        return True if torch.equal(fy.view(torch.int16), want.view(torch.int16)) else "sums differ"

    received = int(per_source.sum())
    ctx.figure(
        f"MoE combine {kind} ({what})",
        lambda: disp.combine(expert_out, weights, handle),
        floor_combine,
        "moe_return_floor + moe_sum_floor",
        f"the {received} rows this rank received ({2 * H} B each) stored back into their sources' "
        f"combine rows, then {T} x {K} rows read and summed per token",
        mode=mode,
        iters=max(20, ctx.iters // 4),
        check=combine_check,
    )


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
