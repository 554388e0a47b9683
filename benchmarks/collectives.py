"""Collectives: symmsync's all-reduce, all-gather and reduce-scatter against NCCL and torch symmetric memory.

Run on a machine with 2 or more NVLinked GPUs (one process per GPU is spawned)::

    python benchmarks/collectives.py [--world 2] [--out benchmarks/results] [--reps 7] [--max-mb 64]

Measures, in one run on the same GPUs, bf16 messages of 1 KB to 64 MB (the all-reduce's
input; the all-gather's output and the reduce-scatter's input have the same bytes), the
time per call, eagerly and in CUDA-graph replay, medians of ``--reps`` runs:
  * symmsync ``AllReduce`` with ``one_shot``, ``two_shot`` and ``auto``; ``AllGather``;
    ``ReduceScatter``;
  * NCCL through torch.distributed: ``all_reduce``, ``all_gather_into_tensor``,
    ``reduce_scatter_tensor``;
  * torch symmetric memory's ``one_shot_all_reduce`` and ``two_shot_all_reduce_`` (never
    its multimem variants: multicast is off on these machines);
  * the host time of an eager symmsync all-reduce call (the clock stops when the call
    returns), against the 8 µs target;
  * host time per call of a decode batch's all-reduce and fused all-reduce + residual +
    RMS norm (8 × 1024 bf16): the plain eager call, the same call compiled with
    ``torch.compile(fullgraph=True)`` (Inductor; the graph holds the ``symmsync::`` op),
    and compiled with ``mode="reduce-overhead"`` (torch's CUDA graphs: a replay per call).
Prints a table of µs and ratios, the size from which two-shot beats one-shot (the
crossover that ``symmsync.collectives.tuning`` should hold), the targets, and writes
``collectives_<machine>.json`` and ``.png`` into ``--out``. Refuses on fewer than 2 GPUs.

With ``SYMMSYNC_SHARE_GPUS=1`` the ranks share the GPUs there are (rank r on GPU
r % count, torch.distributed over gloo: NCCL refuses two ranks on one GPU), and the run
measures host time only (the last item above): the GPU time of ranks that share a GPU
is not an NVLink number, and NCCL and torch symmetric memory do not run there. It
writes ``collectives_<machine>_shared.json``::

    SYMMSYNC_SHARE_GPUS=1 python benchmarks/collectives.py --world 2

``--shared`` measures the GPU time of ranks sharing one GPU under MPS instead, each call beside
a floor kernel that moves its bytes without synchronization and torch's kernels for the same
bytes (``copy_``, ``sum``; the floor rule of ``benchmarks/shared.py`` picks the floor; writes
``collectives_<machine>_mps.json``; ``--host-smoke`` runs it on the host backend)::

    python benchmarks/collectives.py --shared --worlds 2,4,8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

KB = 1024
TARGET_EAGER_HOST_US = 8.0
TARGET_16K_US = 4.0
PORT = 29533
HOST_TOKENS, HOST_HIDDEN = 8, 1024  # the host-time calls: a decode batch, 16 KB of bf16
HOST_CALLS = (("ar", "all-reduce"), ("fused", "fused norm"))
HOST_MODES = (("eager", "eager"), ("compiled", "compiled"), ("reduce_overhead", "reduce-overhead"))

SYMMSYNC_AR = ("one_shot", "two_shot", "auto")
ROWS_AR = [
    ("ss_one_shot", "symmsync one_shot"),
    ("ss_two_shot", "symmsync two_shot"),
    ("ss_auto", "symmsync auto"),
    ("torch_one_shot", "torch symm one_shot_all_reduce"),
    ("torch_two_shot", "torch symm two_shot_all_reduce_"),
    ("nccl_all_reduce", "NCCL all_reduce"),
]
SHORT_AR = ("ss 1shot", "ss 2shot", "ss auto", "th 1shot", "th 2shot", "nccl")
ROWS_OTHER = [
    ("ss_all_gather", "symmsync AllGather"),
    ("nccl_all_gather", "NCCL all_gather_into_tensor"),
    ("ss_reduce_scatter", "symmsync ReduceScatter"),
    ("nccl_reduce_scatter", "NCCL reduce_scatter_tensor"),
]
SHORT_OTHER = ("ss gather", "nccl gather", "ss rs", "nccl rs")


def sizes(max_mb: int) -> list[int]:
    out, b = [], KB
    while b <= max_mb * KB * KB:
        out.append(b)
        b *= 2
    return out


def iters_for(nbytes: int, base: int) -> int:
    """Calls per timed run: fewer for large messages (about 50 ms of data movement each)."""
    return max(10, min(base, (64 << 20) // nbytes * 8))


def sharing_gpus() -> bool:
    """``SYMMSYNC_SHARE_GPUS=1``: the ranks share the GPUs there are (a host-time run)."""
    return os.environ.get("SYMMSYNC_SHARE_GPUS", "0") not in ("", "0")


def init(rank: int, world: int) -> torch.device:
    """One process per rank: on its own GPU over NCCL, or sharing the GPUs over gloo."""
    if not sharing_gpus():
        return common.init_worker(rank, world, PORT)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(PORT))
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return dev


def host_times(ar, dev: torch.device, iters: int, reps: int) -> dict[str, float | None]:
    """Host µs per call (the clock stops when the calls return) of the all-reduce and the fused
    norm: eager, compiled (fullgraph, Inductor) and compiled with ``mode="reduce-overhead"``."""
    g = torch.Generator(dev).manual_seed(dist.get_rank())
    x = torch.randn(HOST_TOKENS, HOST_HIDDEN, generator=g, device=dev).to(torch.bfloat16)
    residual = torch.randn(HOST_TOKENS, HOST_HIDDEN, generator=g, device=dev).to(torch.bfloat16)
    weight = torch.ones(HOST_HIDDEN, dtype=torch.bfloat16, device=dev)
    calls = {
        "ar": lambda x, r: ar(x),
        "fused": lambda x, r: ar(x, residual=r, norm_weight=weight, eps=1e-6),
    }
    out: dict[str, float | None] = {}
    for name, fn in calls.items():
        for mode, _ in HOST_MODES:
            key = f"host_{name}_{mode}"
            step = fn
            if mode == "compiled":
                step = torch.compile(fn, fullgraph=True)
            elif mode == "reduce_overhead":
                step = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
            try:
                with torch.no_grad():  # inference: the ops have no autograd formula
                    step(x, residual)  # compiles (the peers' first calls wait for this rank's)
                    common.sync_all()
                    out[key] = common.eager_us(lambda s=step: s(x, residual), iters, reps, warmup=20, host_only=True)
            except Exception as e:  # noqa: BLE001 - a mode that cannot run is reported, not fatal
                print(f"rank {dist.get_rank()}: host time of {name}, {mode}, failed: {e!r}", flush=True)
                out[key] = None
                common.sync_all()
    return out


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    dev = init(rank, world)
    import torch.distributed._symmetric_memory as symm_mem

    import symmsync as ss
    from symmsync import collectives as C

    group = dist.group.WORLD
    shared = sharing_gpus()
    max_numel = HOST_TOKENS * HOST_HIDDEN if shared else args.max_mb * KB * KB // 2
    per = C.workspace_bytes(max_numel, torch.bfloat16, world)
    buf = ss.SymmetricBuffer(3 * per, backend="cuda")
    view = buf.view(list(range(world)))
    # The budget of a wait covers a peer still compiling: a first compiled call waits for it.
    ar = C.AllReduce(view, max_numel, torch.bfloat16, timeout_s=300.0)
    if shared:  # host time only: the GPU time of ranks that share a GPU means nothing here
        R = host_times(ar, dev, iters=min(args.iters, 100), reps=args.reps)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (R, {}))
        if rank == 0:
            report(gathered, args, shared=True)
        common.sync_all()
        buf.close()
        dist.destroy_process_group()
        return
    ag = C.AllGather(view, max_numel, torch.bfloat16, offset=per, channel=1)
    rs = C.ReduceScatter(view, max_numel, torch.bfloat16, offset=2 * per, channel=2)
    symm = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(symm, group.group_name)
    ops = torch.ops.symm_mem
    R: dict[str, float | None] = {}
    same_bits: dict[int, bool] = {}
    reps = args.reps

    def measure(name: str, fn, nbytes: int) -> None:
        it = iters_for(nbytes, args.iters)
        try:
            R[f"{name}.{nbytes}.eager"] = common.eager_us(fn, iters=it, reps=reps, warmup=5)
            R[f"{name}.{nbytes}.graph"] = common.graph_us(fn, iters=it, reps=reps)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run at a size is reported, not fatal
            print(f"rank {rank}: {name} at {nbytes} B failed: {e!r}", flush=True)
            R[f"{name}.{nbytes}.eager"] = R[f"{name}.{nbytes}.graph"] = None
            torch.cuda.synchronize()
            dist.barrier()

    def one_size(nbytes: int) -> None:
        n = nbytes // 2
        x = torch.randn(n, device=dev).to(torch.bfloat16)
        out = torch.empty_like(x)
        a, b = ar(x, algorithm="one_shot").clone(), ar(x, algorithm="two_shot").clone()
        ar.synchronize()
        same_bits[nbytes] = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
        for algo in SYMMSYNC_AR:
            measure(f"ss_{algo}", lambda algo=algo: ar(x, out, algorithm=algo), nbytes)
        t = symm.narrow(0, 0, n)
        t.copy_(x)
        measure("torch_one_shot", lambda: ops.one_shot_all_reduce(t, "sum", group.group_name), nbytes)
        measure("torch_two_shot", lambda: ops.two_shot_all_reduce_(t, "sum", group.group_name), nbytes)
        y = x.clone()
        measure("nccl_all_reduce", lambda: dist.all_reduce(y, group=group), nbytes)
        part = x[: n // world]  # the all-gather's input: its output has the message's bytes
        gathered = torch.empty(world * part.numel(), dtype=x.dtype, device=dev)
        measure("ss_all_gather", lambda: ag(part, gathered), nbytes)
        measure("nccl_all_gather", lambda: dist.all_gather_into_tensor(gathered, part, group=group), nbytes)
        chunk = torch.empty(n // world, dtype=x.dtype, device=dev)
        xr = x[: world * (n // world)]
        measure("ss_reduce_scatter", lambda: rs(xr, chunk), nbytes)
        measure("nccl_reduce_scatter", lambda: dist.reduce_scatter_tensor(chunk, xr, group=group), nbytes)
        if nbytes == 16 * KB:
            R["ss_auto_host.16384.eager"] = common.eager_us(
                lambda: ar(x, out), iters=args.iters, reps=reps, warmup=50, host_only=True
            )

    for nbytes in sizes(args.max_mb):
        one_size(nbytes)
    R["launch_path"] = next(iter(ar._bound.values())).launcher.path  # type: ignore[assignment]
    R.update(host_times(ar, dev, iters=args.iters, reps=reps))
    gathered_r: list = [None] * world
    dist.all_gather_object(gathered_r, (R, same_bits))
    if rank == 0:
        report(gathered_r, args)
    dist.barrier()
    buf.close()
    dist.destroy_process_group()


def _max(per_rank: list, key: str) -> float | None:
    vals = [r[key] for r in per_rank if r.get(key) is not None]
    return max(vals) if len(vals) == len(per_rank) else None  # the slower rank sets the pace


def crossover(res: dict, mode: str, all_sizes: list[int]) -> int | None:
    """The smallest size from which two-shot is faster than one-shot at every larger size."""
    found = None
    for b in reversed(all_sizes):
        one, two = res.get(f"ss_one_shot.{b}.{mode}"), res.get(f"ss_two_shot.{b}.{mode}")
        if one is None or two is None or two >= one:
            break
        found = b
    return found


def _fmt(v: float | None) -> str:
    return f"{v:9.2f}" if v is not None else f"{'-':>9s}"


def _size(b: int) -> str:
    return f"{b // (KB * KB)} MB" if b >= KB * KB else f"{b // KB} KB"


def host_lines(res: dict) -> list[str]:
    """The host-time table: per call, eager against compiled and reduce-overhead."""
    lines = [
        f"host time per call, {HOST_TOKENS}x{HOST_HIDDEN} bf16 (the clock stops when the call returns), µs:",
        f"{'':>11s} " + " ".join(f"{label:>15s}" for _, label in HOST_MODES) + "  compiled/eager",
    ]
    for name, label in HOST_CALLS:
        vals = [res.get(f"host_{name}_{mode}") for mode, _ in HOST_MODES]
        ratio = f"{vals[1] / vals[0]:13.2f}×" if vals[0] and vals[1] else f"{'-':>14s}"
        lines.append(f"{label:>11s} " + " ".join(f"{_fmt(v):>15s}" for v in vals) + f"  {ratio}")
    return lines


def report(per_rank: list, args: argparse.Namespace, shared: bool = False) -> None:
    info = common.machine()
    stats = [r for r, _ in per_rank]
    keys = {k for r in stats for k, v in r.items() if isinstance(v, float) or v is None}
    res = {k: _max(stats, k) for k in sorted(keys)}
    all_sizes = sizes(args.max_mb)
    lines = [
        f"collectives, {args.world} ranks, bf16, µs per call (max over ranks of the median of {args.reps} runs); "
        f"{info['gpu_count']}× {info['gpus'][0]}, torch {info['torch']}, triton {info['triton']}",
    ]
    if shared:
        lines.append(
            f"the {args.world} ranks share {info['gpu_count']} GPU(s) (SYMMSYNC_SHARE_GPUS=1): host time only; "
            "the GPU time of ranks that share a GPU is not an NVLink number, and NCCL does not run there"
        )
        lines += host_lines(res)
        finish(lines, res, stats, info, args, None, shared)
        return
    for mode in ("graph", "eager"):
        lines.append(f"all-reduce, {mode}:")
        lines.append(f"{'size':>7s} " + " ".join(f"{c:>9s}" for c in SHORT_AR) + "  auto/best-torch  NCCL/auto")
        for b in all_sizes:
            vals = [res.get(f"{k}.{b}.{mode}") for k, _ in ROWS_AR]
            auto, t1, t2, nccl = vals[2], vals[3], vals[4], vals[5]
            best_torch = min(v for v in (t1, t2) if v is not None) if (t1 or t2) else None
            r1 = f"{auto / best_torch:6.2f}×" if auto and best_torch else "     -"
            r2 = f"{nccl / auto:6.2f}×" if auto and nccl else "     -"
            lines.append(f"{_size(b):>7s} " + " ".join(_fmt(v) for v in vals) + f"  {r1:>15s}  {r2:>9s}")
        lines.append(f"all-gather and reduce-scatter, {mode}:")
        lines.append(f"{'size':>7s} " + " ".join(f"{c:>11s}" for c in SHORT_OTHER) + "   NCCL/ss (ag, rs)")
        for b in all_sizes:
            vals = [res.get(f"{k}.{b}.{mode}") for k, _ in ROWS_OTHER]
            ra = f"{vals[1] / vals[0]:5.2f}×" if vals[0] and vals[1] else "    -"
            rr = f"{vals[3] / vals[2]:5.2f}×" if vals[2] and vals[3] else "    -"
            lines.append(f"{_size(b):>7s} " + " ".join(f"{_fmt(v):>11s}" for v in vals) + f"   {ra}, {rr}")
    cross = {m: crossover(res, m, all_sizes) for m in ("graph", "eager")}
    lines.append(
        "one-shot / two-shot crossover (two-shot faster from this size on): "
        + ", ".join(f"{m}: {_size(c) if c else 'none up to ' + _size(all_sizes[-1])}" for m, c in cross.items())
        + f"; put the graph one into symmsync/collectives/tuning.py for {args.world} members"
    )
    bits = all(sb for _, s in per_rank for sb in s.values())
    lines.append(f"one-shot and two-shot gave the same bits at every size on every rank: {bits}")
    lines.append("targets (graph replay, bf16):")
    miss = []
    for b in all_sizes:
        auto = res.get(f"ss_auto.{b}.graph")
        t1, t2 = res.get(f"torch_one_shot.{b}.graph"), res.get(f"torch_two_shot.{b}.graph")
        nccl = res.get(f"nccl_all_reduce.{b}.graph")
        if auto is None:
            continue
        best = min(v for v in (t1, t2, float("inf")) if v is not None)
        if b <= 8 * KB * KB and auto > best:
            miss.append(f"{_size(b)}: {auto:.2f} > torch {best:.2f}")
        if b <= 256 * KB and nccl and nccl / auto < 2:
            miss.append(f"{_size(b)}: only {nccl / auto:.2f}× NCCL")
    lines.append("  at most the faster torch algorithm up to 8 MB, 2× NCCL up to 256 KB: " + ("; ".join(miss) or "met"))
    a16 = res.get(f"ss_auto.{16 * KB}.graph")
    if a16 is not None:
        lines.append(
            f"  at most {TARGET_16K_US} µs at 16 KB: {a16:.2f} µs ({'met' if a16 <= TARGET_16K_US else 'MISSED'})"
        )
    big = all_sizes[-1]
    a_big, n_big = res.get(f"ss_auto.{big}.graph"), res.get(f"nccl_all_reduce.{big}.graph")
    if a_big and n_big:
        frac = n_big / a_big
        lines.append(
            f"  at least 90% of NCCL's bandwidth at {_size(big)}: {frac:.0%} ({'met' if frac >= 0.9 else 'MISSED'})"
        )
    host = res.get("ss_auto_host.16384.eager")
    if host is not None:
        lines.append(
            f"  host time per eager call (16 KB, auto) at most {TARGET_EAGER_HOST_US} µs: {host:.2f} µs "
            f"({'met' if host <= TARGET_EAGER_HOST_US else 'MISSED'})"
        )
    lines += host_lines(res)
    lines.append(f"launch path: {per_rank[0][0].get('launch_path')}")
    finish(lines, res, stats, info, args, cross, shared)


def finish(lines: list[str], res: dict, stats: list, info: dict, args, cross: dict | None, shared: bool) -> None:
    """Print the table; write the JSON (and, with the sweep, the PNG)."""
    text = "\n".join(lines)
    print(text, flush=True)
    name = f"collectives_{common.slug(info)}"
    if args.world != 2:
        name += f"_w{args.world}"
    if shared:
        name += "_shared"
    payload = {
        "machine": info,
        "world": args.world,
        "shared_gpus": shared,
        "results_us": res,
        "per_rank_us": stats,
        "crossover_bytes": cross,
        "reps": args.reps,
        "table": text,
    }
    common.write_json(os.path.join(args.out, name + ".json"), payload)
    if shared:
        print(f"wrote {os.path.join(args.out, name)}.json", flush=True)
        return
    plot(res, info, sizes(args.max_mb), os.path.join(args.out, name + ".png"), args.world)
    print(f"wrote {os.path.join(args.out, name)}.json and .png", flush=True)


def plot(res: dict, info: dict, all_sizes: list[int], path: str, world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, mode in zip(axes, ("graph", "eager")):
        for key, label in ROWS_AR + ROWS_OTHER:
            pts = [(b, res.get(f"{key}.{b}.{mode}")) for b in all_sizes]
            pts = [(b, v) for b, v in pts if v is not None]
            if pts:
                style = "-" if key.startswith("ss_") else "--"
                ax.plot([b for b, _ in pts], [v for _, v in pts], style, marker=".", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message bytes (bf16)")
        ax.set_ylabel("µs per call (log)")
        ax.set_title(f"{'CUDA graph replay' if mode == 'graph' else 'eager'}", fontsize=10)
        ax.grid(True, which="both", lw=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"Collectives, {world} ranks, {info['gpu_count']}× {info['gpus'][0]} ({info.get('link_gpu0_gpu1', '?')}), "
        f"torch {info['torch']}, triton {info['triton']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SHARED_SIZES = (16 * KB, 256 * KB, KB * KB)  # bf16 all-reduce messages under MPS
SHARED_NORM = (8, 4096)  # the fused all-reduce + residual + RMS norm: a decode batch
HOST_SMOKE_SIZES, HOST_SMOKE_NORM = (4 * KB,), (2, 256)  # on the host backend (--host-smoke): float32


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def shared_rank(ctx) -> None:
    """Ranks sharing one GPU under MPS (``benchmarks/shared.py``): each collective beside its floor.

    The floors run in a second buffer of the same size, at the collectives' workspace offsets
    (input slot of parity 0, reduced chunk), so that they never touch a header or a counter.
    Beside each, torch's kernels for the same bytes on local tensors (``copy_`` for the copy-in
    and copy-out, ``sum`` over a ``[members, n]`` stack for the sums): the floor rule of
    ``shared.py`` picks the floor."""
    import floors

    import symmsync as ss
    from symmsync import collectives as C

    host = ctx.backend == "host"
    w, dev, dt = ctx.world, ctx.device, torch.float32 if host else torch.bfloat16
    sizes, (t, h) = (HOST_SMOKE_SIZES, HOST_SMOKE_NORM) if host else (SHARED_SIZES, SHARED_NORM)
    es = torch.tensor([], dtype=dt).element_size()
    max_numel = max(sizes) // es
    per = C.workspace_bytes(max_numel, dt, w)
    buf = ss.SymmetricBuffer(3 * per, backend=ctx.backend)
    fbuf = ss.SymmetricBuffer(3 * per, backend=ctx.backend)
    try:
        view, fview = buf.view(list(range(w))), fbuf.view(list(range(w)))
        ar = C.AllReduce(view, max_numel, dt, timeout_s=ctx.wait_s)
        ag = C.AllGather(view, max_numel, dt, offset=per, channel=1, timeout_s=ctx.wait_s)
        rs = C.ReduceScatter(view, max_numel, dt, offset=2 * per, channel=2, timeout_s=ctx.wait_s)
        ptrs, me, sms = fview.ptrs, fview.local_index, ctx.sms
        g = torch.Generator(dev).manual_seed(ctx.rank)

        def floor(x, out, ws, mode, chunk=0):
            return lambda: floors.launch_collective(x, out, ptrs, me, ws.inputs, ws.reduced, w, mode, sms, chunk)

        def same(op, fl, fout):
            # The floor's output, once every member's floor has left its bytes (two rounds, barriers
            # between), against the operation's: a floor that moved nothing would differ.
            def check():
                want = op().clone()
                ctx.barrier()
                for _ in range(2):
                    fl()
                    ctx.barrier()
                return True if torch.equal(_bits(fout), _bits(want)) else "bits differ"

            return check

        def local(*shape):
            return torch.randn(*shape, generator=g, device=dev).to(dt)

        def torch_reduce(x, n_sum, rest=0):
            # copy_ of the input; sum of a local [members, n_sum] stack; copy_ of `rest` elements out.
            xin, stack, red = torch.empty_like(x), local(w, n_sum), torch.empty(n_sum, dtype=dt, device=dev)
            src, dst = local(max(rest, 1)), torch.empty(max(rest, 1), dtype=dt, device=dev)

            def fn():
                xin.copy_(x)
                torch.sum(stack, 0, out=red)
                if rest:
                    dst.copy_(src)

            return fn

        for nbytes in sizes:
            n = nbytes // es
            nb = n * es
            x = local(n)
            out, fout = torch.empty_like(x), torch.empty_like(x)
            chunk = floors.two_shot_chunk(n, w)
            for algo, mode, moves, tfn, moved in (
                ("one_shot", floors.ONE_SHOT, f"copy-in of {_size(nb)}, then {w} x {_size(nb)} read "
                 f"(every member's slot) and {_size(nb)} written", torch_reduce(x, n), (w + 3) * nb),
                ("two_shot", floors.TWO_SHOT, f"copy-in of {_size(nb)}; this rank's 1/{w} read from {w} "
                 f"members, summed into its reduced chunk and the output; {w - 1} other reduced chunks read",
                 torch_reduce(x, chunk, n), 5 * nb),
            ):  # fmt: skip
                fl = floor(x, fout, ar.workspace, mode, chunk)
                ctx.figure(
                    f"AllReduce {algo} {_size(nb)}",
                    lambda algo=algo, x=x, out=out: ar(x, out, algorithm=algo),
                    fl,
                    f"collective_floor {algo}",
                    moves,
                    check=same(lambda algo=algo, x=x: ar(x, algorithm=algo), fl, fout),
                    torch_floor={"copy_ + sum over the members" + (" + copy_ out" if algo == "two_shot" else ""): tfn},
                    bytes_moved=moved,
                    tags={"what": "all_reduce", "algorithm": algo, "bytes": nb},
                )
        xr, res = local(t, h), local(t, h)
        weight = torch.ones(h, dtype=dt, device=dev)
        fout = torch.empty_like(xr)
        fl = floor(xr, fout, ar.workspace, floors.ONE_SHOT)
        ctx.figure(
            f"AllReduce + residual + RMS norm {t}x{h}",
            lambda: ar(xr, residual=res, norm_weight=weight, eps=1e-6),
            fl,
            "collective_floor one_shot",
            f"the one-shot floor of {_size(t * h * es)}: the norm's extra reads and writes are not in it",
            more={"plain AllReduce, same size": lambda: ar(xr)},
            check=same(lambda: ar(xr), fl, fout),
            torch_floor={"copy_ + sum over the members": torch_reduce(xr, t * h)},
            bytes_moved=(w + 3) * t * h * es,
            tags={"what": "all_reduce_norm"},
        )
        n = max_numel
        x = local(n)
        part = x[: n // w]
        gathered, fgathered = (torch.empty(w * part.numel(), dtype=dt, device=dev) for _ in range(2))
        fl = floor(part, fgathered, ag.workspace, floors.GATHER)
        pin, gsrc, gdst = torch.empty_like(part), local(w * part.numel()), torch.empty_like(gathered)
        ctx.figure(
            f"AllGather {_size(n * es)} out",
            lambda: ag(part, gathered),
            fl,
            "collective_floor gather",
            f"copy-in of {_size(part.numel() * es)}, then every member's slot read into the output",
            check=same(lambda: ag(part), fl, fgathered),
            torch_floor={"copy_ in + copy_ of the output": lambda: (pin.copy_(part), gdst.copy_(gsrc))},
            bytes_moved=2 * part.numel() * es + 2 * w * part.numel() * es,
            tags={"what": "all_gather"},
        )
        xs = x[: w * (n // w)]
        chunk, fchunk = (torch.empty(n // w, dtype=dt, device=dev) for _ in range(2))
        fl = floor(xs, fchunk, rs.workspace, floors.SCATTER, n // w)
        ctx.figure(
            f"ReduceScatter {_size(n * es)} in",
            lambda: rs(xs, chunk),
            fl,
            "collective_floor scatter",
            f"copy-in of {_size(n * es)}, then this rank's 1/{w} read from every member and summed",
            check=same(lambda: rs(xs), fl, fchunk),
            torch_floor={"copy_ + sum over the members": torch_reduce(xs, n // w)},
            bytes_moved=3 * xs.numel() * es + (n // w) * es,
            tags={"what": "reduce_scatter"},
        )
    finally:
        ctx.barrier()
        buf.close()
        fbuf.close()


def main() -> None:
    if "--shared" in sys.argv[1:]:
        import shared

        sys.exit(shared.main(sys.argv[1:], bench="collectives"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--world", type=int, default=2, help="GPUs (one process each)")
    parser.add_argument("--iters", type=int, default=500, help="calls per timed run at small sizes")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--max-mb", type=int, default=64, help="largest message, MB")
    args = parser.parse_args()
    n = torch.cuda.device_count()
    if sharing_gpus():
        if n < 1 or args.world < 2:
            sys.exit(f"SYMMSYNC_SHARE_GPUS=1 benchmarks/collectives.py: needs a GPU and --world >= 2 (GPUs: {n})")
        torch.multiprocessing.spawn(worker, args=(args.world, args), nprocs=args.world, join=True)
        return
    if n < 2 or args.world < 2 or n < args.world:
        sys.exit(
            f"benchmarks/collectives.py measures collectives between GPUs: it needs --world >= 2 GPUs and this "
            f"machine has {n} (asked for --world {args.world}). Run it on a machine with 2 or more NVLinked GPUs, "
            "or measure host time only with the ranks sharing a GPU: SYMMSYNC_SHARE_GPUS=1."
        )
    args.tp = 1
    common.spawn(worker, args, "benchmarks/collectives.py")


if __name__ == "__main__":
    main()
