"""Fence latency: symmsync against torch's barrier, NCCL and the launch floor.

Run on a machine with NVLinked GPUs (one process per GPU is spawned)::

    python benchmarks/fence.py [--world 2] [--tp 1] [--out benchmarks/results] [--iters 1000] [--reps 9]

The fence spans the PCP view of ``--world`` ranks with TP size ``--tp`` (``--world 4
--tp 2``: two 2-rank views, {0, 2} and {1, 3}, fencing concurrently on one buffer);
the baselines run over the same ranks (torch's barrier and NCCL on that subgroup).

Measures, in one run on the same GPUs, the time per fence of:
  * symmsync ``Fence.fence()`` (one launch, the cuda-python launch path), eager and in
    CUDA-graph replay; ``arrive()`` + ``wait()``;
  * the same fence kernel launched through Triton's own launcher, and as two Triton
    launches (publish, then wait): what a straightforward implementation does;
  * torch symmetric memory's ``barrier()``; NCCL ``all_reduce`` of one int;
  * an empty kernel (the floor), through Triton and through symmsync's launcher;
  * where a fence's time goes (graph replay): epoch + publish alone, a wait that is
    already satisfied, and the full fence;
  * overlap: ``arrive()``, a kernel that computes for ~12 µs, ``wait()``, against the
    compute kernel alone.
Medians of ``--reps`` repetitions after warm-up. Prints a table with ratios and
writes ``fence_<machine>[_<layout>].json`` and ``.png`` into ``--out`` (no suffix for 2 ranks).
The instruction candidates are 2-member kernels: measured only when the view has 2 members.

``--shared`` measures instead ranks sharing one GPU under MPS, each fence beside its floor and
torch's ``copy_`` of the floor's bytes (``benchmarks/shared.py``; writes ``fence_<machine>_mps.json``)::

    python benchmarks/fence.py --shared --worlds 2,4,8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync.language as ssl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TARGET_GRAPH_US = 2.0
TARGET_EAGER_US = 5.0
TARGET_OVERLAP = 0.10


@triton.jit
def empty_kernel(x):
    pass


@triton.jit
def spin_kernel(ns):
    start = ssl.clock_ns()
    now = start
    while now - start < ns:
        now = ssl.clock_ns()


@triton.jit
def _st_release(ptr, v):
    tl.inline_asm_elementwise(
        "st.release.sys.global.b64 [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,l",
        [ptr, v],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _red_release(ptr, v):
    tl.inline_asm_elementwise(
        "red.release.sys.global.add.u64 [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,l",
        [ptr, v],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _fence_then_relaxed(ptr, v):
    tl.inline_asm_elementwise(
        "fence.acq_rel.sys;\n\tst.relaxed.sys.global.b64 [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,l",
        [ptr, v],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _ld_acquire(ptr):
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _ld_relaxed(ptr):
    return tl.inline_asm_elementwise(
        "ld.relaxed.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _acquire_fence():
    tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def variant_fence(ptrs, cell, me, PUB: tl.constexpr, POLL: tl.constexpr):
    """Candidate instruction choices for a 2-rank fence (one peer), measured side by side.

    PUB: 0 st.release.sys, 1 red.release.sys.add (slot counts arrivals), 2 fence + st.relaxed.
    POLL: 0 ld.acquire.sys per poll, 1 ld.relaxed.sys polls then one fence.acq_rel.sys.
    No time budget (measurement only).
    """
    peer = 1 - me
    ep = ssl.epoch_ptr(ptrs, cell, me)
    e = tl.load(ep) + 1
    tl.store(ep, e)
    dst = ssl.peer_ptr(ptrs, peer, cell + ssl.SLOTS, tl.int64) + me
    if PUB == 0:
        _st_release(dst, e)
    elif PUB == 1:
        _red_release(dst, e - e + 1)
    else:
        _fence_then_relaxed(dst, e)
    mine = ssl.peer_ptr(ptrs, me, cell + ssl.SLOTS, tl.int64) + peer
    if POLL == 0:
        v = _ld_acquire(mine)
        while v < e:
            v = _ld_acquire(mine)
    else:
        v = _ld_relaxed(mine)
        while v < e:
            v = _ld_relaxed(mine)
        _acquire_fence()


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    dev = common.init_worker(rank, world, 29531)
    import symmsync as ss
    from symmsync.core import fence as fence_mod
    from symmsync.core.launch import Launcher

    buf = ss.SymmetricBuffer(1 << 20, backend="cuda", channels=16)
    view = ss.pcp_view(buf, tp=args.tp)
    group = common.pcp_group(world, args.tp)
    fences = [ss.Fence(view, channel=c) for c in range(16)]
    it, reps = args.iters, args.reps
    R: dict[str, float] = {}

    def both(name: str, fn) -> None:
        R[f"{name}.eager"] = common.eager_us(fn, iters=2 * it, reps=reps)
        R[f"{name}.graph"] = common.graph_us(fn, iters=it, reps=reps)

    # symmsync, fast launch path
    f0 = fences[0]
    both("symmsync_fence", f0.fence)
    f1 = fences[1]

    def arrive_wait():
        f1.arrive()
        f1.wait()

    both("symmsync_arrive_wait", arrive_wait)

    # The same kernels through Triton's launcher (what a plain Triton fence costs).
    def triton_launch(f, arrive, wait):
        kw = dict(SIZE=view.size, ARRIVE=arrive, WAIT=wait, TRAP=True, num_warps=1)
        return lambda: fence_mod._fence_kernel[(1,)](*f.kernel_args, **kw)

    tl_fence = triton_launch(fences[2], True, True)
    both("triton_launcher_fence", tl_fence)
    tl_pub, tl_wait = triton_launch(fences[3], True, False), triton_launch(fences[3], False, True)

    def two_launch():
        tl_pub()
        tl_wait()

    both("triton_two_launch", two_launch)

    # Baselines
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(1 << 20, dtype=torch.uint8, device=dev)
    hdl = symm_mem.rendezvous(t, group.group_name)
    both("torch_symm_barrier", lambda: hdl.barrier(channel=0))
    x = torch.zeros(1, dtype=torch.int32, device=dev)
    R["nccl_allreduce.eager"] = common.eager_us(lambda: dist.all_reduce(x, group=group), iters=it, reps=reps)
    R["nccl_allreduce.graph"] = common.graph_us(
        lambda: dist.all_reduce(x, group=group), iters=max(it // 4, 50), reps=reps
    )
    both("empty_triton", lambda: empty_kernel[(1,)](x, num_warps=1))
    empty_fast = Launcher(empty_kernel, (1,), num_warps=1).bind(x)
    both("empty_symmsync_launcher", empty_fast)

    # Instruction candidates for publish and poll (graph replay), each on its own channel.
    for i, (pub, poll) in enumerate(VARIANTS if view.size == 2 else ()):
        f = fences[8 + i]
        k = Launcher(variant_fence, (1,), num_warps=1, PUB=pub, POLL=poll).bind(
            view.cell_ptrs, f.cell, view.local_index
        )
        R[f"variant_pub{pub}_poll{poll}.graph"] = common.graph_us(k, iters=it, reps=reps)

    # Where the time goes (graph replay): publish alone, a satisfied wait, the full fence.
    def variant(f, arrive, wait):
        return Launcher(
            fence_mod._fence_kernel, (1,), num_warps=1, SIZE=view.size, ARRIVE=arrive, WAIT=wait, TRAP=True
        ).bind(*f.kernel_args)

    R["breakdown_arrive_only.graph"] = common.graph_us(variant(fences[4], True, False), iters=it, reps=reps)
    R["breakdown_wait_satisfied.graph"] = common.graph_us(variant(fences[5], False, True), iters=it, reps=reps)

    # Overlap: arrive, ~12 µs of compute, wait; and the fence on a side stream (Fence.overlap).
    spin_ns = 12_000
    spin = Launcher(spin_kernel, (1,), num_warps=1).bind(spin_ns)
    f6 = fences[6]

    def overlapped():
        f6.arrive()
        spin()
        f6.wait()

    f7 = fences[7]

    def side_stream():
        with f7.overlap():
            spin()

    R["overlap_compute_alone.graph"] = common.graph_us(spin, iters=it, reps=reps)
    R["overlap_arrive_compute_wait.graph"] = common.graph_us(overlapped, iters=it, reps=reps)
    R["overlap_side_stream.graph"] = common.graph_us(side_stream, iters=it, reps=reps)
    R["overlap_side_stream.eager"] = common.eager_us(side_stream, iters=it, reps=reps)
    R["overlap_compute_alone.eager"] = common.eager_us(spin, iters=it, reps=reps)
    R["launch_path"] = f0.launch_path  # type: ignore[assignment]
    R["epochs_after"] = [f.epoch for f in fences]  # type: ignore[assignment]

    gathered: list = [None] * world
    dist.all_gather_object(gathered, R)
    if rank == 0:
        report(gathered, args)
    dist.barrier()
    buf.close()
    dist.destroy_process_group()


VARIANTS = ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1))


def layout_name(world: int, tp: int) -> str:
    return f"{world} ranks" if tp == 1 else f"TP{tp}×PCP{world // tp} (two {world // tp}-rank views)"


ROWS = [
    ("symmsync_fence", "symmsync Fence.fence() (one launch)"),
    ("symmsync_arrive_wait", "symmsync arrive() + wait()"),
    ("triton_launcher_fence", "same fence kernel, Triton's launcher"),
    ("triton_two_launch", "publish then wait, two Triton launches"),
    ("torch_symm_barrier", "torch symmetric-memory barrier"),
    ("nccl_allreduce", "NCCL all_reduce of one int"),
    ("empty_triton", "empty kernel, Triton's launcher"),
    ("empty_symmsync_launcher", "empty kernel, symmsync launcher"),
]


def report(per_rank: list, args: argparse.Namespace) -> None:
    info = common.machine()
    keys = [k for k, v in per_rank[0].items() if isinstance(v, float)]
    res = {k: max(r[k] for r in per_rank) for k in keys}  # the slower rank sets the pace
    sym_g, sym_e = res["symmsync_fence.graph"], res["symmsync_fence.eager"]
    lines = [
        f"fence latency, {layout_name(args.world, args.tp)}, µs per fence "
        f"(max over ranks of the median of {args.reps} runs); "
        f"{info['gpu_count']}× {info['gpus'][0]}, torch {info['torch']}, triton {info['triton']}",
        f"{'':44s} {'graph':>8s} {'eager':>8s}   vs symmsync (graph / eager)",
    ]
    for key, label in ROWS:
        g, e = res.get(f"{key}.graph"), res.get(f"{key}.eager")
        lines.append(f"{label:44s} {g:8.2f} {e:8.2f}   {g / sym_g:5.2f}× / {e / sym_e:5.2f}×")
    arrive_only = res["breakdown_arrive_only.graph"]
    wait_sat = res["breakdown_wait_satisfied.graph"]
    empty_g = res["empty_symmsync_launcher.graph"]
    lines += [
        "where a fence's time goes (graph replay, µs):",
        f"  kernel node floor (empty kernel)            {empty_g:8.2f}",
        f"  epoch + release reductions to peers, no wait {arrive_only:7.2f}",
        f"  acquire polls of a satisfied wait           {wait_sat:8.2f}",
        f"  full fence                                  {sym_g:8.2f}",
        f"  -> waiting on the peer (cross-GPU latency)  {sym_g - max(arrive_only, wait_sat):8.2f}",
    ]
    c = res["overlap_compute_alone.graph"]
    o = res["overlap_arrive_compute_wait.graph"]
    side = res["overlap_side_stream.graph"]
    overlap = (side - c) / sym_g
    lines += (
        [
            f"  eager launch of an empty kernel: symmsync {res['empty_symmsync_launcher.eager']:.2f} µs, "
            f"Triton {res['empty_triton.eager']:.2f} µs",
            "instruction candidates, 2-rank fence without a time budget (graph replay, µs):"
            if "variant_pub0_poll0.graph" in res
            else "instruction candidates: not measured (2-member views only)",
        ]
        + [
            f"  publish {['st.release.sys', 'red.release.sys.add', 'fence.acq_rel + st.relaxed'][p]:28s} "
            f"poll {['ld.acquire.sys', 'ld.relaxed + fence'][q]:20s} {res[f'variant_pub{p}_poll{q}.graph']:6.2f}"
            for p, q in VARIANTS
            if f"variant_pub{p}_poll{q}.graph" in res
        ]
        + [
            f"overlap (graph): compute alone {c:.2f} µs; arrive + compute + wait on one stream {o:.2f} µs "
            f"(+{o - c:.2f}); Fence.overlap() side stream {side:.2f} µs (+{side - c:.2f} = {overlap:.1%} of a fence)",
            f"overlap (eager): compute alone {res['overlap_compute_alone.eager']:.2f} µs; "
            f"Fence.overlap() {res['overlap_side_stream.eager']:.2f} µs",
            "targets:",
            f"  graph replay <= {TARGET_GRAPH_US} µs: {sym_g:.2f} µs "
            f"({'met' if sym_g <= TARGET_GRAPH_US else 'MISSED by %.2f µs' % (sym_g - TARGET_GRAPH_US)}); "
            f"{res['torch_symm_barrier.graph'] / sym_g:.2f}× faster than torch's barrier (target >= 1.4×)",
            f"  eager <= {TARGET_EAGER_US} µs: {sym_e:.2f} µs "
            f"({'met' if sym_e <= TARGET_EAGER_US else 'MISSED by %.2f µs' % (sym_e - TARGET_EAGER_US)}); "
            f"{res['torch_symm_barrier.eager'] / sym_e:.2f}× faster than torch's barrier (target >= 1.5×)",
            f"  overlap <= {TARGET_OVERLAP:.0%}: {overlap:.1%} ({'met' if overlap <= TARGET_OVERLAP else 'MISSED'})",
            f"launch path: {per_rank[0]['launch_path']}; epochs after the run (rank 0): {per_rank[0]['epochs_after']}",
        ]
    )
    text = "\n".join(lines)
    print(text, flush=True)
    name = f"fence_{common.slug(info)}"
    if (args.world, args.tp) != (2, 1):
        name += f"_w{args.world}" + (f"_tp{args.tp}" if args.tp > 1 else "")
    payload = {
        "machine": info,
        "world": args.world,
        "tp": args.tp,
        "results_us": res,
        "per_rank_us": per_rank,
        "iters": args.iters,
        "reps": args.reps,
        "overlap_fraction": overlap,
        "table": text,
    }
    common.write_json(os.path.join(args.out, name + ".json"), payload)
    plot(res, info, os.path.join(args.out, name + ".png"), layout_name(args.world, args.tp))
    print(f"wrote {os.path.join(args.out, name)}.json and .png", flush=True)


def plot(res: dict, info: dict, path: str, label: str = "2 ranks") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for _, label in ROWS]
    g = [res[f"{k}.graph"] for k, _ in ROWS]
    e = [res[f"{k}.eager"] for k, _ in ROWS]
    fig, ax = plt.subplots(figsize=(10, 5))
    ys = range(len(ROWS))
    ax.barh([y - 0.2 for y in ys], g, height=0.4, label="CUDA graph replay")
    ax.barh([y + 0.2 for y in ys], e, height=0.4, label="eager")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(TARGET_GRAPH_US, color="C0", ls="--", lw=1)
    ax.axvline(TARGET_EAGER_US, color="C1", ls="--", lw=1)
    ax.set_xlabel("µs per fence (log)")
    ax.set_title(
        f"Fence latency, {label}, {info['gpu_count']}× {info['gpus'][0]} ({info.get('link_gpu0_gpu1', '?')}), "
        f"torch {info['torch']}, triton {info['triton']}",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def shared_rank(ctx) -> None:
    """Ranks sharing one GPU under MPS (``benchmarks/shared.py``): the fence beside its floors."""
    import floors

    import symmsync as ss
    from symmsync.core.launch import Launcher

    w = ctx.world
    buf = ss.SymmetricBuffer(1 << 16, backend=ctx.backend, channels=4)
    try:
        view = buf.view(list(range(w)))
        fence = ss.Fence(view, channel=0, timeout_s=ctx.wait_s)
        # The floor stores into the slots of channel 3, which no fence uses: the same cells' memory.
        store = Launcher(floors.publish_floor, (1,), num_warps=1, SIZE=w).bind(
            view.cell_ptrs, view.cell_offset(3), view.local_index, 7
        )
        x = torch.zeros(1, device=ctx.device)
        empty = Launcher(floors.empty_kernel, (1,), num_warps=1).bind(x)
        src = torch.arange(max(1, w - 1), dtype=torch.int64, device=ctx.device)
        dst = torch.empty_like(src)  # torch's kernel for the floor's bytes: a copy_ of w - 1 int64
        moves = f"one int64 store into the slot this rank has at each of the {w - 1} other members, one launch"
        for mode in ("graph", "eager"):
            ctx.figure(
                "Fence.fence()" + (" eager" if mode == "eager" else ""),
                fence.fence,
                store,
                "publish_floor (the publish without its wait)",
                moves,
                mode=mode,
                iters=4 * ctx.iters if mode == "graph" else 2 * ctx.iters,
                more={"empty kernel": empty},
                torch_floor={f"copy_ of {w - 1} int64": lambda: dst.copy_(src)},
                tags={"what": "fence", "mode": mode},
            )
    finally:
        ctx.barrier()
        buf.close()


def main() -> None:
    if "--shared" in sys.argv[1:]:
        import shared

        sys.exit(shared.main(sys.argv[1:], bench="fence"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--iters", type=int, default=1000, help="fences per graph (eager: twice as many)")
    parser.add_argument("--reps", type=int, default=9)
    common.add_layout_args(parser)
    common.spawn(worker, parser.parse_args(), "benchmarks/fence.py")


if __name__ == "__main__":
    main()
