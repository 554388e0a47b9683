"""The PCP writer on one GPU, local replica only, against a minimal quantize-and-insert floor.

Run on one GPU::

    python benchmarks/pcp_local.py [--out benchmarks/results] [--tokens 4096 16384 32768] [--sweep]
    python benchmarks/pcp_local.py --profile 32768 --slots contiguous   # under Nsight Compute

At PCP1 (a world of one rank) the writer's direct route writes only the local
replica, so this measures its kernel against the least a quantize-and-insert of the
same bytes costs: the floor kernel below, written from the format rules with the
hardware fp8 conversion, power-of-two scales and ``[rows, 128]`` tiles, one program
per 8 tokens (the fastest of three block shapes is kept). For 4k, 16k and 32k tokens
and two slot patterns (contiguous: slot = token, as for a fresh sequence; scattered: a
random permutation of the cache's slots) it measures

  * ``writer_us`` / ``floor_us``: µs per call in CUDA-graph replay; ``copy_us``: a
    device-to-device copy that reads and writes as many bytes as the writer does (its
    inputs read, its cache bytes written), the same way; ``writer_tb_per_s``: those bytes
    per second of the writer's time;
  * ``writer_eager_us``: µs per eager ``write()``, back to back (the GPU's time or the
    host's, whichever is longer);
  * ``host_us``: host time of one eager ``write()``, the GPU running behind it
    (``host_new_inputs_us``: the same when every call's inputs are other tensors than
    the last call's, which repacks their addresses in the launch); and, once per run,
    ``launch_floor_us``: the same timing of an empty kernel's launch through
    :mod:`symmsync.core.launch`, the part of a ``write()`` that is the driver's.

The floor rule of ``benchmarks/shared.py`` is applied to each row (``floor_rule``): a floor kernel
slower than 1.1x torch's ``copy_`` of the writer's bytes gives way to that copy's figure.

The writer runs with its defaults (``DirectKVWriter(view, layout)``: the fused fence
tail, one launch per layer). Before timing, the writer's bytes are compared with the
floor's (the same format: power-of-two main-KV scales, ue8m0 indexer scales), eagerly
and after a graph replay. ``--sweep`` also times a grid of :class:`symmsync.pcp.Tuning`
choices (the measurement the defaults come from). Prints a table and writes
``pcp_local_<machine>.json`` (a ``rows`` list) and ``.png`` into ``--out``.

``--profile T`` launches each kernel twice (a warm-up, then the measured launch) at
``T`` tokens for Nsight Compute, e.g.::

    ncu --clock-control none --kernel-name regex:"floor|quantize_write" \\
        --metrics lts__t_sectors_srcunit_tex_op_write.sum,gpu__time_duration.sum \\
        python benchmarks/pcp_local.py --profile 32768 --slots contiguous
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NOPE, ROPE, IDX = 512, 64, 128  # bf16 values per row of kv_c, k_pe, indexer_k
MAIN, INDEXER = 656, 132  # cache bytes per token (block size 64)
FLOOR_SHAPES = ((8, 4), (16, 4), (32, 8))  # (tokens per program, warps)


@triton.jit
def _pow2_at_least(m):
    """The smallest power of two >= m (positive normal fp32), and its reciprocal."""
    b = m.to(tl.int32, bitcast=True)
    e = (b >> 23) & 0xFF
    e = tl.where((b & 0x7FFFFF) != 0, e + 1, e)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _floor_kernel(kv, pe, ix, slots, out_main, out_idx, T, BLOCK_T: tl.constexpr):
    # One program per BLOCK_T tokens; each token's bytes at its slot (block size 64).
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    slot = tl.load(slots + rows, mask=live, other=0)
    c = tl.arange(0, 128)
    for j in tl.static_range(4):
        x = tl.load(kv + rows[:, None] * 512 + j * 128 + c[None, :], mask=live[:, None], other=0).to(tl.float32)
        s, inv = _pow2_at_least(tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1e-4))
        q = (x * inv[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(out_main + slot[:, None] * 656 + j * 128 + c[None, :], q, mask=live[:, None])
        tl.store((out_main + slot * 656 + 512 + j * 4).to(tl.pointer_type(tl.float32), bitcast=True), s, mask=live)
    c64 = tl.arange(0, 64)
    p = tl.load(pe + rows[:, None] * 64 + c64[None, :], mask=live[:, None], other=0)
    rope = (out_main + slot[:, None] * 656 + 528).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    tl.store(rope + c64[None, :], p, mask=live[:, None])
    xi = tl.load(ix + rows[:, None] * 128 + c[None, :], mask=live[:, None], other=0).to(tl.float32)
    si, invi = _pow2_at_least(tl.math.div_rn(tl.maximum(tl.max(tl.abs(xi), axis=1), 1e-4), 448.0))
    qi = (xi * invi[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    block, off = slot // 64, slot % 64
    tl.store(out_idx + (block * 64 * 132 + off * 128)[:, None] + c[None, :], qi, mask=live[:, None])
    scale = (out_idx + block * 64 * 132 + 64 * 128 + off * 4).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale, si, mask=live)


@triton.jit
def _empty_kernel(x):
    pass


def launch_floor_us() -> float:
    """Host time of launching an empty kernel through symmsync's launch path, timed as
    ``host_us`` is: the part of a write() that no Python of the writer's can remove."""
    from symmsync.core.launch import Launcher

    bound = Launcher(_empty_kernel, (1,)).bind(torch.zeros(4, device="cuda"))
    bound()
    return common.eager_us(bound, iters=40, reps=25, host_only=True)


class Case:
    """One size and slot pattern: inputs, the writer's cache and the floor's."""

    def __init__(self, tokens: int, pattern: str, seed: int = 0):
        import symmsync as ss
        from symmsync import pcp

        dev = torch.device("cuda", 0)
        self.tokens, self.pattern = tokens, pattern
        self.blocks = tokens // 64 + 1
        self.layout = pcp.CacheLayout(num_blocks=self.blocks, num_layers=1, base=0)
        self.buf = ss.SymmetricBuffer(self.layout.end, backend="cuda", channels=2)
        self.view = ss.pcp_view(self.buf)  # PCP1: the local replica only
        g = torch.Generator(device=dev).manual_seed(seed)
        self.inputs = [torch.randn(tokens, w, device=dev, generator=g).to(torch.bfloat16) for w in (NOPE, ROPE, IDX)]
        if pattern == "contiguous":
            self.slots = torch.arange(tokens, device=dev)
        else:
            self.slots = torch.randperm(self.blocks * 64, device=dev, generator=g)[:tokens].contiguous()
        self.out_main = torch.zeros(self.blocks * 64 * MAIN, device=dev, dtype=torch.uint8)
        self.out_idx = torch.zeros(self.blocks * 64 * INDEXER, device=dev, dtype=torch.uint8)

    def writer(self, **tuning):
        from symmsync import pcp

        w = pcp.DirectKVWriter(self.view, self.layout, timeout_s=30, **tuning)
        batch = w.prepare(self.slots)
        return lambda: w.write(0, *self.inputs, batch)

    def writer_alternating(self):
        """The default writer, its inputs alternating between two sets of tensors: a layer
        whose inputs live elsewhere than the last layer's."""
        from symmsync import pcp

        w = pcp.DirectKVWriter(self.view, self.layout, timeout_s=30)
        batch = w.prepare(self.slots)
        sets = [self.inputs, [t.clone() for t in self.inputs]]
        turn = [0]

        def write():
            turn[0] ^= 1
            w.write(0, *sets[turn[0]], batch)

        return write

    def floor(self, block_t: int, warps: int):
        grid = (triton.cdiv(self.tokens, block_t),)
        args = (*self.inputs, self.slots, self.out_main, self.out_idx, self.tokens)
        return lambda: _floor_kernel[grid](*args, BLOCK_T=block_t, num_warps=warps)

    def cache_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        main = self.layout.main_kv(self.buf, 0).reshape(-1)
        return main, self.layout.indexer_k(self.buf, 0).reshape(-1)

    def same_bytes(self) -> bool:
        """The writer's cache equals the floor's, byte for byte (the floor wrote last)."""
        main, idx = self.cache_bytes()
        torch.cuda.synchronize()
        return bool(torch.equal(main, self.out_main) and torch.equal(idx, self.out_idx))

    def clear(self) -> None:
        for t in (*self.cache_bytes(), self.out_main, self.out_idx):
            t.zero_()

    def close(self) -> None:
        self.buf.close()


def graph_us(fn) -> float:
    return common.graph_us(fn, iters=20, reps=15)


def measure(case: Case, writer_tuning: dict) -> dict:
    floors = {f"{bt}x{nw}": graph_us(case.floor(bt, nw)) for bt, nw in FLOOR_SHAPES}
    write = case.writer(**writer_tuning)
    # Bytes first: eagerly, then after graph replay (the cache cleared between).
    case.clear()
    case.floor(*FLOOR_SHAPES[0])()
    write()
    eager_ok = case.same_bytes()
    case.clear()
    case.floor(*FLOOR_SHAPES[0])()
    writer_graph = graph_us(write)
    graph_ok = case.same_bytes()
    # A device-to-device copy with the writer's traffic: it reads and writes as many bytes as
    # the writer reads (its inputs) and writes (the cache bytes) together.
    traffic = case.tokens * (2 * (NOPE + ROPE + IDX) + MAIN + INDEXER)
    src = torch.empty(traffic // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy = graph_us(lambda: dst.copy_(src))
    # The floor rule of benchmarks/shared.py: a floor kernel slower than 1.1x torch's kernel for the
    # same bytes (here torch's copy_ of the writer's byte count) is replaced by torch's figure.
    from shared_results import choose_floor

    floor_us = min(floors.values())
    used_us, used = choose_floor(floor_us, copy)
    return {
        "tokens": case.tokens,
        "slots": case.pattern,
        "traffic_bytes": traffic,
        "copy_us": copy,
        "writer_tb_per_s": traffic / writer_graph / 1e6,
        "writer_us": writer_graph,
        "floor_us": floor_us,
        "floor_shapes_us": floors,
        "floor_rule": {
            "kernel_us": floor_us,
            "torch": "copy_ of the writer's bytes read + written",
            "torch_us": copy,
            "used": used,
            "writer_ratio": writer_graph / used_us if used_us else None,
        },
        # Few calls per timing, so that the launch queue never fills behind a slower GPU.
        "host_us": common.eager_us(write, iters=40, reps=25, host_only=True),
        "host_new_inputs_us": common.eager_us(case.writer_alternating(), iters=40, reps=25, host_only=True),
        "writer_eager_us": common.eager_us(write, iters=50, reps=7),
        "bytes_equal_eager": eager_ok,
        "bytes_equal_graph": graph_ok,
    }


SWEEP = [  # Tuning fields (and fused=False: the writer kernel, then a fence launch)
    {"block_rows": 4, "num_warps": 1, "programs_per_sm": 8},
    {"block_rows": 4, "num_warps": 2, "programs_per_sm": 8},
    {"block_rows": 8, "num_warps": 2, "programs_per_sm": 4},
    {"block_rows": 8, "num_warps": 4, "programs_per_sm": 3},
    {"block_rows": 4, "num_warps": 1, "programs_per_sm": 0},
    {"block_rows": 8, "num_warps": 2, "programs_per_sm": 0},
    {"block_rows": 16, "num_warps": 4, "programs_per_sm": 0},
    {"block_rows": 16, "num_warps": 8, "programs_per_sm": 0},
    {"block_rows": 4, "num_warps": 1, "programs_per_sm": 8, "fused": False},
]


def sweep(cases: list[Case]) -> list[dict]:
    out = []
    for case in cases:
        for cfg in SWEEP:
            try:
                t = graph_us(case.writer(**cfg))
            except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, the rest still runs
                print(f"{case.tokens} {case.pattern} {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
                t = float("nan")
            out.append({"tokens": case.tokens, "slots": case.pattern, **cfg, "writer_us": t})
    return out


def profile(tokens: int, pattern: str) -> None:
    """Each kernel twice (warm-up, measured), for a profiler to read the second launch."""
    case = Case(tokens, pattern)
    write = case.writer(fused=True)
    for fn in (case.floor(*FLOOR_SHAPES[0]), write):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    case.close()


def table(rows: list[dict]) -> str:
    head = (
        f"{'tokens':>7} {'slots':>10} {'writer':>8} {'floor':>8} {'ratio':>6} {'copy':>7} {'TB/s':>5} {'eager':>8} "
        f"{'host':>7} {'host*':>7}  bytes"
    )
    lines = [head]
    for r in rows:
        ok = "equal" if r["bytes_equal_eager"] and r["bytes_equal_graph"] else "DIFFER"
        lines.append(
            f"{r['tokens']:>7} {r['slots']:>10} {r['writer_us']:>8.1f} {r['floor_us']:>8.1f} "
            f"{r['writer_us'] / r['floor_us']:>6.2f} {r['copy_us']:>7.1f} {r['writer_tb_per_s']:>5.2f} "
            f"{r['writer_eager_us']:>8.1f} {r['host_us']:>7.2f} "
            f"{r['host_new_inputs_us']:>7.2f}  {ok}"
        )
    lines.append(
        "µs: writer, floor, copy (a device copy of the writer's bytes read + written): graph replay; TB/s: the "
        "writer's bytes read + written per µs; eager: per write(); host: per write(); host*: new input tensors"
    )
    return "\n".join(lines)


def plot(rows: list[dict], info: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for pattern, marker in (("contiguous", "o"), ("scattered", "s")):
        sel = [r for r in rows if r["slots"] == pattern]
        t = [r["tokens"] for r in sel]
        ax.plot(t, [r["writer_us"] for r in sel], marker=marker, label=f"writer, {pattern} slots")
        ax.plot(t, [r["floor_us"] for r in sel], marker=marker, ls="--", label=f"floor kernel, {pattern} slots")
        bx.plot(t, [r["host_us"] for r in sel], marker=marker, label=f"host time per write(), {pattern}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("µs per layer (graph replay)")
    ax.legend(fontsize=8)
    bx.axhline(8.0, color="grey", ls=":", label="8 µs")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("tokens")
    bx.set_ylabel("µs of host time per eager write()")
    bx.legend(fontsize=8)
    fig.suptitle(
        f"PCP writer, local replica only, {info['gpus'][0]}, torch {info['torch']}, triton {info['triton']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of Tuning choices")
    parser.add_argument("--profile", type=int, metavar="T", help="launch each kernel twice at T tokens and exit")
    parser.add_argument("--slots", default="contiguous", choices=("contiguous", "scattered"), help="for --profile")
    args = parser.parse_args()
    if torch.cuda.device_count() < 1:
        sys.exit("benchmarks/pcp_local.py needs a GPU")
    common.init_worker(0, 1, 29541)  # a world of one: the writer's view is the local replica
    if args.profile:
        profile(args.profile, args.slots)
        return
    info = common.machine()
    rows, cases = [], []
    for tokens in args.tokens:
        for pattern in ("contiguous", "scattered"):
            case = Case(tokens, pattern)
            rows.append(measure(case, {}))
            print(table(rows[-1:]).splitlines()[1], flush=True)
            cases.append(case)
    floor_launch = launch_floor_us()
    swept = sweep(cases) if args.sweep else []
    for case in cases:
        case.close()
    text = table(rows)
    name = f"pcp_local_{common.slug(info)}"
    from symmsync import pcp

    common.write_json(
        os.path.join(args.out, name + ".json"),
        {
            "machine": info,
            "what": "PCP1 (local replica only): writer defaults vs a minimal quantize-and-insert floor",
            "units": "µs per layer; writer_us and floor_us in graph replay, host_us per eager write()",
            "writer_tuning": dataclasses.asdict(pcp.Tuning()),
            "launch_floor_us": floor_launch,
            "rows": rows,
            "sweep": swept,
            "table": text,
        },
    )
    plot(rows, info, os.path.join(args.out, name + ".png"))
    if swept:
        print("\nTuning sweep (graph replay, µs):")
        for r in swept:
            cfg = {k: v for k, v in r.items() if k not in ("tokens", "slots", "writer_us")}
            print(f"  {r['tokens']:>6} {r['slots']:>10} {r['writer_us']:7.1f}  {cfg}")
    print(f"\n{info['gpus'][0]} ({info['host']}), torch {info['torch']}, triton {info['triton']}")
    print(text)
    print(f"host time of an empty kernel's launch through symmsync.core.launch, timed as host: {floor_launch:.2f} µs")
    print(f"wrote {os.path.join(args.out, name)}.json and .png", flush=True)


if __name__ == "__main__":
    main()
