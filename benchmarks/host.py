"""Host cost per call, side by side with torch's own ops, in one run on one GPU.

Run on a machine with one NVIDIA GPU or more::

    python benchmarks/host.py [--out benchmarks/results] [--iters 200] [--reps 7] [--skip-decode]

Host µs per call: the clock stops when the calls return (the GPU runs behind; between
repetitions the host waits for it), the median of ``--reps`` rounds of ``--iters`` calls,
after a warm-up. The calls are timed in turns (each round times every call once), so
that a drift of the host's speed falls on all of them alike; the JSON keeps each call's
quartiles and extremes (``spread``). Everything below runs in one process at world 1 (a one-rank NCCL group,
so that NCCL and torch's symmetric memory run too; world 1 keeps every peer out of the
figures: host cost only), but for the decode step, which runs on 2 ranks sharing the GPU
(``SYMMSYNC_SHARE_GPUS=1``, gloo), as a tensor-parallel pair would:

* **calls** (8 × 1024 bf16, a decode batch), eager and compiled (``torch.compile``,
  fullgraph, Inductor, not graphed): a torch elementwise op (``x.mul(2)``); NCCL's
  all-reduce (torch.distributed; compiled, its functional collective); torch's
  symmetric-memory ``one_shot_all_reduce`` (a C++ op); symmsync's all-reduce, fused
  all-reduce + residual + RMS norm, all-gather, reduce-scatter and fence; and symmsync's
  ops called alone, as a split graph calls an op between its pieces ("op alone"); for
  scale, an op registered as symmsync's are whose body only allocates its output
  (``python_op``: the least a Python op costs), and symmsync's all-reduce op called
  directly in the compiled function (``ar_op``: without tracing through the object);
* **under** ``mode="reduce-overhead"`` (torch's CUDA graph trees): a torch op, torch's
  one-shot, symmsync's all-reduce and fused call, each ``+ 1`` so that a graph holds more
  than the op; with torch's counter of skipped graphs;
* **the PCP writer** at 64 and 4096 tokens (a decode batch, a prefill chunk), per layer:
  one torch elementwise op on the rows; ``write()`` eager; its op called as a split
  graph calls a splitting op between compiled pieces (vLLM's piecewise prefill); a
  compiled 2-layer step (write, read of the cache; Inductor, not graphed); that step in a
  CUDA graph (replay); and under ``reduce-overhead`` (which torch's graph trees skip:
  the caches are mutated inputs);
* **the MoE dispatcher** (128 tokens, hidden 7168, top-8, 8 experts, bf16, its one member: host
  cost only): ``dispatch`` and ``combine`` eager (two bound launches each), beside a torch op on
  the tokens (``x.mul(2)``) and ``index_select`` of the same 1024 rows; and their parts: the
  same calls without their launches (``*_no_launch``), a dispatch's six output allocations
  (``dispatch_outputs``; ``_merged``: its four int64 tensors cut from one), one ``torch.empty``
  (``empty``; ``empty_0``: of no element);
* **a decode step** of 8 layers (a GEMM, then the fused all-reduce + residual + RMS
  norm), 16 tokens, eager, compiled, and compiled in a CUDA graph (replay), against the
  same model with local torch ops in place of the all-reduce (no communication); each
  rank's bits checked against its eager step, and the ranks' outputs against each other.

Prints the table, the targets of docs/performance.md ("Host cost per call") with the
ratios, and writes ``host_<machine>.json`` and ``.png`` into ``--out``. ``--only moe`` (or
``calls``, ``writer``; may repeat) times only those parts, without the decode step, and writes
``host_<machine>_moe.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TOKENS, HIDDEN = 8, 1024  # a decode batch: 16 KB of bf16
LAYERS, DECODE_TOKENS, DECODE_STEPS = 8, 16, 40
WRITER_TOKENS = (64, 4096)
PORT = 29571
MOE_ROWS = (  # the MoE rows of the table: the calls, then their parts
    "torch_op", "index_select", "dispatch", "combine", "dispatch_no_launch", "combine_no_launch",
    "dispatch_outputs", "dispatch_outputs_merged", "empty", "empty_0",
)  # fmt: skip

TARGETS = [  # (name, what is compared, limit): the targets, as ratios of this run's figures
    ("compiled all-reduce <= 1.0x torch's compiled one_shot", ("ar", "compiled"), ("torch_one_shot", "compiled"), 1.0),
    ("compiled fused <= 1.0x torch's compiled one_shot", ("fused", "compiled"), ("torch_one_shot", "compiled"), 1.0),
    ("eager all-reduce <= 0.8x torch's eager one_shot", ("ar", "eager"), ("torch_one_shot", "eager"), 0.8),
    ("eager fused <= 1.0x torch's eager one_shot", ("fused", "eager"), ("torch_one_shot", "eager"), 1.0),
]


def host_us(fn, iters: int, reps: int, warmup: int = 20, sync=None) -> float:
    """Median host µs per call of ``iters`` back-to-back calls; the GPU catches up between reps."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters * 1e6)
        sync()
    return round(statistics.median(times), 2)


def interleaved(cases: dict, iters: int, reps: int) -> tuple[dict, dict]:
    """Host µs per call of every case, timed in turns: each round times ``iters`` calls of each
    case in order, so a drift of the host's speed (this VM's moves by half between runs) falls
    on every case alike. Returns (the median of the rounds, their quartiles and extremes)."""
    samples: dict = {k: [] for k in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - t0) / iters * 1e6)
    torch.cuda.synchronize()
    medians = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    spread = {k: [round(q, 2) for q in (min(v), *statistics.quantiles(v, n=4), max(v))] for k, v in samples.items()}
    return medians, spread


def prepare(cases: dict, failed: dict, name: str, make) -> None:
    """Add ``make()`` (a call, made ready: compiled, warmed up) as case ``name``, or the error
    that stopped it to ``failed`` (never fatal: the other rows still run)."""
    try:
        fn = make()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        cases[name] = fn
    except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, the rest still runs
        failed[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        print(f"  {name}: {failed[name]}", flush=True)


def graphed(fn):
    """``fn`` captured in a CUDA graph after a warm-up on a side stream; returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    graphed.keep.append(g)
    return g.replay


graphed.keep = []  # the graphs of the replays timed, alive until the run ends


# ---------------------------------------------------------------------- world 1
def calls(cases: dict, failed: dict, notes: dict, keep: list) -> None:
    """The collectives' and torch's calls (8 × 1024 bf16): eager, compiled, under reduce-overhead."""
    import torch.distributed._functional_collectives as fc
    import torch.distributed._symmetric_memory as symm_mem
    from torch._dynamo.utils import counters

    import symmsync as ss
    from symmsync import collectives as C

    n = TOKENS * HIDDEN
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    r = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.rand(HIDDEN, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    per = -(-C.workspace_bytes(n, torch.bfloat16, 1) // 128) * 128
    buf = ss.SymmetricBuffer(3 * per, backend="cuda")
    keep.append(buf)
    view = buf.view([0])
    ar = C.AllReduce(view, n, torch.bfloat16, timeout_s=60)
    ag = C.AllGather(view, n, torch.bfloat16, offset=per, channel=1, timeout_s=60)
    rs = C.ReduceScatter(view, n, torch.bfloat16, offset=2 * per, channel=2, timeout_s=60)
    fence = ss.Fence(view, 3, timeout_s=60)
    keep.extend((ar, ag, rs, fence))
    gname = dist.group.WORLD.group_name
    t = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(t, gname)
    t.copy_(x.view(-1))
    torch._dynamo.mark_static_address(t)  # graph trees would copy it out of symmetric memory
    one_shot = torch.ops.symm_mem.one_shot_all_reduce
    fns = {  # name: (the call, its arguments)
        "torch_op": (lambda u: u.mul(2), (x,)),
        "nccl_all_reduce": (lambda u: fc.all_reduce(u, "sum", dist.group.WORLD), (x,)),
        "torch_one_shot": (lambda u: one_shot(u, "sum", gname), (t,)),
        "ar": (lambda u: ar(u), (x,)),
        "fused": (lambda u, v: ar(u, residual=v, norm_weight=w, eps=1e-6), (x, r)),
        "all_gather": (lambda u: ag(u), (x,)),
        "reduce_scatter": (lambda u: rs(u), (x,)),
        "fence": (lambda u: fence.fence(), (x,)),
    }
    # The least a Python-registered op costs: one defined as symmsync's are, whose body only
    # allocates its output; and symmsync's all-reduce op called in the graph directly (no
    # tracing through the object: what its __call__ adds to the guards).
    lib = torch.library.Library("host_bench", "DEF")
    keep.append(lib)
    lib.define("alloc(Tensor x, int h, str a) -> Tensor")
    lib.impl("alloc", lambda u, h, a: torch.empty_like(u), "CUDA")
    torch.library.register_fake("host_bench::alloc", lambda u, h, a: torch.empty_like(u), lib=lib)
    fns["python_op"] = (lambda u: torch.ops.host_bench.alloc(u, 1, "a"), (x,))
    fns["ar_op"] = (lambda u: torch.ops.symmsync.all_reduce(u, ar.op_handle, "auto"), (x,))
    eager = {**fns, "nccl_all_reduce": (lambda u: dist.all_reduce(u), (x,))}
    for name, (f, args) in eager.items():
        prepare(cases, failed, f"{name}.eager", lambda f=f, args=args: lambda: f(*args))
    for name, (f, args) in fns.items():
        prepare(cases, failed, f"{name}.compiled", lambda f=f, args=args: compiled(f, args))
    ops = {  # the op as a split graph calls it between compiled pieces
        "ar": lambda: torch.ops.symmsync.all_reduce.default(x, ar.op_handle, "auto"),
        "fused": lambda: torch.ops.symmsync.all_reduce_residual_rms_norm.default(x, r, w, 1e-6, ar.op_handle, "auto"),
        "fence": lambda: torch.ops.symmsync.fence.default(fence.op_handle, 0, fence.orders()),
    }
    for name, f in ops.items():
        prepare(cases, failed, f"{name}.between_pieces", lambda f=f: f)
    plus_one = {  # under reduce-overhead, each + 1: a graph holds more than the op
        "torch_op": (lambda u: u.mul(2) + 1, (x,)),
        "torch_one_shot": (lambda u: one_shot(u, "sum", gname) + 1, (t,)),
        "ar": (lambda u: ar(u) + 1, (x,)),
        "fused": (lambda u, v: ar(u, residual=v, norm_weight=w, eps=1e-6)[0] + 1, (x, r)),
    }
    for name, (f, args) in plus_one.items():
        counters.clear()
        prepare(cases, failed, f"{name}.reduce_overhead", lambda f=f, args=args: compiled(f, args, "reduce-overhead"))
        notes[f"{name}.reduce_overhead_skips"] = {
            k: v for k, v in counters.get("inductor", {}).items() if "cudagraph" in k
        }
    with torch.no_grad():
        y = torch.compile(lambda u: ar(u), fullgraph=True)(x)
    torch.cuda.synchronize()
    notes["ar_compiled_equals_input_at_world_1"] = bool(torch.equal(y, x))
    notes["launch_path"] = ar._bound and next(iter(ar._bound.values())).launcher.path


def compiled(f, args, mode=None):
    """``f`` compiled (fullgraph, Inductor; or ``mode``), as a call of ``args``."""
    cf = torch.compile(f, fullgraph=True, mode=mode)
    return lambda: cf(*args)


def writer(cases: dict, failed: dict, notes: dict, keep: list) -> None:
    for T in WRITER_TOKENS:
        writer_at(T, cases, failed, notes, keep)


def writer_at(T: int, cases: dict, failed: dict, notes: dict, keep: list) -> None:
    """The writer's rows at ``T`` tokens (one layer per call but for the 2-layer steps)."""
    from torch._dynamo.utils import counters

    import symmsync as ss
    from symmsync import pcp

    nb = T // 64 + 1
    layout = pcp.CacheLayout(num_blocks=nb, num_layers=2, base=0)
    buf = ss.SymmetricBuffer(layout.end, backend="cuda")
    w = pcp.DirectKVWriter(ss.pcp_view(buf), layout, channel=0, timeout_s=60)
    g = torch.Generator("cuda").manual_seed(T)
    kv, pe, ix = (torch.randn(T, d, device="cuda", generator=g).to(torch.bfloat16) for d in (512, 64, 128))
    slots = torch.randperm(nb * 64, device="cuda", generator=g)[:T].contiguous()
    batch = w.prepare(slots)
    keep.extend((buf, w, batch))
    layer_span = w.span(0)  # the span the op declares it mutates, as a split graph passes it
    op = torch.ops.symmsync.kv_write.default

    def step(kv, pe, ix):
        w.write(0, kv, pe, ix, batch)
        w.write(1, kv, pe, ix, batch)
        return w.caches(1)[0].view(-1)[:16].clone()

    key = f"writer.{T}"
    prepare(cases, failed, f"{key}.torch_op", lambda: lambda: kv.mul(2))
    prepare(cases, failed, f"{key}.eager", lambda: lambda: w.write(0, kv, pe, ix, batch))
    prepare(
        cases, failed, f"{key}.between_pieces", lambda: lambda: op(w.op_handle, 0, kv, pe, ix, batch.slots, layer_span)
    )
    prepare(cases, failed, f"{key}.compiled_step_2_layers", lambda: compiled(step, (kv, pe, ix)))
    cs = cases.get(f"{key}.compiled_step_2_layers")
    if cs is not None:
        prepare(cases, failed, f"{key}.graph_step_2_layers", lambda: graphed(cs))
    counters.clear()
    prepare(
        cases, failed, f"{key}.reduce_overhead_step_2_layers", lambda: compiled(step, (kv, pe, ix), "reduce-overhead")
    )
    notes[f"{key}.reduce_overhead_skips"] = {k: v for k, v in counters.get("inductor", {}).items() if "cudagraph" in k}


def moe(cases: dict, failed: dict, notes: dict, keep: list) -> None:
    """The dispatcher's eager calls at its one member (host cost: no peer), beside torch ops, and
    their parts: the same calls of a second dispatcher whose launches are left out (the Python of
    the call and its output allocations), and the allocations alone, as a dispatch makes them."""
    import symmsync as ss
    from symmsync import moe as ssmoe

    E, M, H, K = 8, 128, 7168, 8
    nbytes = -(-ssmoe.buffer_bytes(E, M, H, torch.bfloat16, K, 1) // 4096) * 4096
    buf = ss.SymmetricBuffer(2 * nbytes, backend="cuda")
    disp = ssmoe.Dispatcher(buf.view([0]), E, M, H, torch.bfloat16, K, timeout_s=60)
    bare = ssmoe.Dispatcher(buf.view([0]), E, M, H, torch.bfloat16, K, offset=nbytes, timeout_s=60)
    bare._launch = lambda *a: None  # noqa: SLF001 - its calls without their two launches
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(M)])
    w = torch.rand(M, K, device="cuda", generator=g)
    recv, counts, handle = disp.dispatch(x, ids)
    rows = torch.arange(M, device="cuda").repeat_interleave(K)
    keep.extend((buf, disp, bare, recv, handle))
    i64, R = torch.int64, M  # one member: members * max_tokens received rows an expert

    def outputs():  # what a dispatch allocates: recv, scales (empty without fp8), counts, src, per_source, offsets
        return (
            torch.empty((E, R, H), dtype=torch.bfloat16, device="cuda"),
            torch.empty(0, dtype=torch.float32, device="cuda"),
            torch.empty(E, dtype=i64, device="cuda"),
            torch.empty((E, R), dtype=i64, device="cuda"),
            torch.empty((E, 1), dtype=i64, device="cuda"),
            torch.empty((E, 1), dtype=i64, device="cuda"),
        )

    def merged():  # the same, the four int64 tensors cut from one allocation
        c, s, p, o = torch.empty(E + E * R + 2 * E, dtype=i64, device="cuda").split((E, E * R, E, E))
        return torch.empty((E, R, H), dtype=torch.bfloat16, device="cuda"), c, s.view(E, R), p.view(E, 1), o.view(E, 1)

    prepare(cases, failed, "moe.torch_op", lambda: lambda: x.mul(2))
    prepare(cases, failed, "moe.index_select", lambda: lambda: x.index_select(0, rows))
    # A combine takes a handle of its dispatcher's last two dispatches: each dispatch case keeps its latest.
    last = {disp: handle, bare: bare.dispatch(x, ids)[2]}
    prepare(cases, failed, "moe.dispatch", lambda: lambda: last.__setitem__(disp, disp.dispatch(x, ids)[2]))
    prepare(cases, failed, "moe.combine", lambda: lambda: disp.combine(recv, w, last[disp]))
    prepare(cases, failed, "moe.dispatch_no_launch", lambda: lambda: last.__setitem__(bare, bare.dispatch(x, ids)[2]))
    prepare(cases, failed, "moe.combine_no_launch", lambda: lambda: bare.combine(recv, w, last[bare]))
    prepare(cases, failed, "moe.dispatch_outputs", lambda: outputs)
    prepare(cases, failed, "moe.dispatch_outputs_merged", lambda: merged)
    prepare(cases, failed, "moe.empty", lambda: lambda: torch.empty((M, H), dtype=torch.bfloat16, device="cuda"))
    prepare(cases, failed, "moe.empty_0", lambda: lambda: torch.empty(0, dtype=torch.float32, device="cuda"))
    notes["moe"] = {"tokens": M, "hidden": H, "top_k": K, "experts": E, "members": 1}


# ---------------------------------------------------------------------- report
def ratio(R: dict, a: str, b: str) -> float | None:
    x, y = R.get(a), R.get(b)
    return round(x / y, 3) if isinstance(x, float) and isinstance(y, float) and y else None


def _target(name: str, q: float | None, limit: float) -> dict:
    """One target's row: its ratio (``None``: not measured) against its limit."""
    return {"target": name, "ratio": q, "limit": limit, "met": q is not None and q <= limit}


def targets(R: dict, decode_result) -> list[dict]:
    out = [_target(name, ratio(R, f"{a}.{am}", f"{b}.{bm}"), limit) for name, (a, am), (b, bm), limit in TARGETS]
    for T in WRITER_TOKENS:
        for what, limit in (("eager", 1.3), ("between_pieces", 1.5)):
            q = ratio(R, f"writer.{T}.{what}", f"writer.{T}.torch_op")
            out.append(_target(f"write() {what} at {T} tokens <= {limit}x a torch op", q, limit))
    for name in ("ar", "fused"):
        q = ratio(R, f"{name}.reduce_overhead", "torch_op.reduce_overhead")
        out.append(_target(f"{name} under reduce-overhead <= 1.2x a torch op's", q, 1.2))
    for name in ("dispatch", "combine"):  # the MoE issue's: host µs per eager call <= 2x a torch op's
        out.append(_target(f"MoE {name} eager <= 2.0x a torch op", ratio(R, f"moe.{name}", "moe.torch_op"), 2.0))
    if isinstance(decode_result, list):
        worst = max(
            decode_result, key=lambda rep: rep["host_us_step"]["compiled"] / rep["host_us_step"]["local_compiled"]
        )
        u = worst["host_us_step"]
        q = round(u["compiled"] / u["local_compiled"], 3)
        out.append(_target("compiled 8-layer decode step <= 1.3x without communication", q, 1.3))
    return out


def table(R: dict) -> str:
    modes = ("eager", "compiled", "between_pieces", "reduce_overhead")
    lines = [f"{'call (host µs per call)':24s} {'eager':>9} {'compiled':>9} {'op alone':>9} {'reduce-ovh':>10}"]
    for name in (
        "torch_op",
        "nccl_all_reduce",
        "torch_one_shot",
        "ar",
        "fused",
        "all_gather",
        "reduce_scatter",
        "fence",
    ):
        cells = [R.get(f"{name}.{m}") for m in modes]
        lines.append(f"{name:24s} " + " ".join(f"{c:>9.2f}" if isinstance(c, float) else f"{'-':>9}" for c in cells))
    for T in WRITER_TOKENS:
        lines.append(f"writer at {T} tokens (per layer; steps are 2 layers):")
        for what in (
            "torch_op",
            "eager",
            "between_pieces",
            "compiled_step_2_layers",
            "graph_step_2_layers",
            "reduce_overhead_step_2_layers",
        ):
            v = R.get(f"writer.{T}.{what}")
            lines.append(f"  {what:32s} {v:>9.2f}" if isinstance(v, float) else f"  {what:32s} {v}")
    lines.append("MoE dispatcher, eager (128 tokens, 7168, top-8, one member):")
    for what in MOE_ROWS:
        v = R.get(f"moe.{what}")
        lines.append(f"  {what:32s} {v:>9.2f}" if isinstance(v, float) else f"  {what:32s} {v}")
    return "\n".join(lines)


def plot(R: dict, decode_result, info: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["torch_op", "python_op", "torch_one_shot", "ar", "ar_op", "fused", "all_gather", "reduce_scatter", "fence"]
    modes = ("eager", "between_pieces", "compiled", "reduce_overhead")
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(18, 5), gridspec_kw={"width_ratios": [3, 2, 1.2]})
    width = 0.2
    for k, mode in enumerate(modes):
        vals = [R.get(f"{n}.{mode}") for n in names]
        vals = [v if isinstance(v, float) else 0.0 for v in vals]
        label = {"between_pieces": "op alone (as between compiled pieces)"}.get(mode, mode)
        ax.bar([i + (k - 1.5) * width for i in range(len(names))], vals, width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("host µs per call (8 × 1024 bf16, world 1)")
    ax.legend(fontsize=8)
    whats = ["torch_op", "eager", "between_pieces", "compiled_step_2_layers", "graph_step_2_layers"]
    for k, T in enumerate(WRITER_TOKENS):
        vals = [R.get(f"writer.{T}.{w}") for w in whats]
        vals = [v if isinstance(v, float) else 0.0 for v in vals]
        bx.bar([i + (k - 0.5) * 0.4 for i in range(len(whats))], vals, 0.4, label=f"{T} tokens")
    bx.set_xticks(range(len(whats)), whats, rotation=30, ha="right", fontsize=8)
    bx.set_ylabel("writer: host µs (per layer; the steps hold 2 layers)")
    bx.legend(fontsize=8)
    if isinstance(decode_result, list):
        steps = ["eager", "local_eager", "compiled", "local_compiled", "graph", "local_graph"]
        for k, rep in enumerate(decode_result):
            vals = [rep["host_us_step"][s] for s in steps]
            cx.bar([i + (k - 0.5) * 0.4 for i in range(len(steps))], vals, 0.4, label=f"rank {k}")
        cx.set_xticks(range(len(steps)), steps, rotation=30, ha="right", fontsize=8)
        cx.set_yscale("log")
        cx.set_ylabel("8-layer decode step: host µs (2 ranks, one GPU)")
        cx.legend(fontsize=8)
    fig.suptitle(f"symmsync host cost, {info['gpus'][0]}, torch {info['torch']}, triton {info['triton']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--skip-decode", action="store_true", help="leave out the 2-rank decode step")
    parser.add_argument(
        "--only",
        choices=("calls", "writer", "moe"),
        action="append",
        help="time only these parts (may repeat; no decode step); writes host_<machine>_<parts>.json",
    )
    parser.add_argument("--plot", metavar="JSON", help="draw the plot of a written JSON again (no GPU) and exit")
    args = parser.parse_args()
    if args.plot:
        import json

        with open(args.plot) as f:
            d = json.load(f)
        plot(d["results"], d["decode"], d["machine"], args.plot.removesuffix(".json") + ".png")
        return
    if torch.cuda.device_count() < 1:
        sys.exit("benchmarks/host.py needs a GPU")
    common.init_worker(0, 1, PORT)
    info = common.machine()
    cases, failed, notes, keep = {}, {}, {}, []
    with torch.no_grad():
        print("preparing the calls (world 1): compiling, warming up", flush=True)
        parts = {"calls": calls, "writer": writer, "moe": moe}
        for part in args.only or parts:
            parts[part](cases, failed, notes, keep)
        print(f"timing {len(cases)} calls in turns: {args.reps} rounds of {args.iters} calls each", flush=True)
        R, spread = interleaved(cases, args.iters, args.reps)
    R.update(failed)
    for k, v in R.items():
        print(f"  {k:44s} {v}", flush=True)
    del cases, keep
    graphed.keep.clear()
    dist.destroy_process_group()
    from host_decode import decode  # the decode step: its own torchrun job

    decode_result = "skipped" if args.skip_decode or args.only else decode()
    print("decode step (2 ranks sharing the GPU):", decode_result, flush=True)
    met = targets(R, decode_result)
    text = table(R)
    name = f"host_{common.slug(info)}" + ("_" + "_".join(args.only) if args.only else "")
    common.write_json(
        os.path.join(args.out, name + ".json"),
        {
            "machine": info,
            "what": "host µs per call, the clock stopped when the calls return; world 1 but the decode step",
            "results": R,
            "spread": spread,
            "notes": notes,
            "rounds": {"reps": args.reps, "iters": args.iters},
            "decode": decode_result,
            "targets": met,
            "table": text,
        },
    )
    plot(R, decode_result, info, os.path.join(args.out, name + ".png"))
    print(f"\n{info['gpus'][0]} ({info['host']}), torch {info['torch']}, triton {info['triton']}")
    print(text)
    for t in met:
        verdict = "not measured" if t["ratio"] is None else "met   " if t["met"] else "MISSED"
        print(f"  {verdict} {t['target']}: {t['ratio']}")
    print(f"wrote {os.path.join(args.out, name)}.json and .png", flush=True)


if __name__ == "__main__":
    main()
