"""symmsync's main demo: a DeepSeek-V3.2-shaped prefill publishes its KV cache over PCP.

    python examples/pcp_kv.py                      # host backend, 2 ranks, finishes in seconds
    python examples/pcp_kv.py --pcp 4 --tp 1       # 4 ranks
    python examples/pcp_kv.py --tp 2 --pcp 2       # TP2 x PCP2: each TP rank publishes in its PCP group
    python examples/pcp_kv.py --backend cuda       # one GPU per rank (needs tp * pcp GPUs)
    python examples/pcp_kv.py --format fp32,fp32   # the legacy cache format (vLLM <= 0.11)
    torchrun --nproc-per-node 2 examples/pcp_kv.py # torchrun's processes are the ranks

Every rank owns the tokens of two of the prompt's 2*PCP chunks. For every layer it
publishes those tokens' final cache bytes (fp8_ds_mla main KV, 656 B/token, and the
indexer K, 132 B/token) into every replica of its PCP group, by both routes:

  direct     quantize once, write into every replica through peer pointers, one fence
  allgather  all-gather the bf16 inputs over the PCP group, then insert locally

The cache format is ``--format MAIN,INDEXER``: main-KV scales ``pow2`` (default; vLLM
>= 0.33, FlashMLA) or ``fp32`` (vLLM <= 0.11), indexer scales ``ue8m0`` (default),
``fp32`` or ``mxfp8``. Then it cross-checks the routes (every replica of both routes
holds identical bytes: a cross-check, not an oracle, since both routes run the same
quantize-and-write kernel; the byte oracle, references written from the format rules,
is tests/oracles.py) and prints per-layer times of a whole prefill, the bytes each
rank moves, and the speedup of direct. On GPUs the prefill is timed twice: eagerly
(each layer's write issued from Python, as a runtime runs long prefills) and as one
CUDA graph replay.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import pcp
from symmsync.testing import is_main_process, run

SHAPES = {"kv_c": 512, "k_pe": 64, "indexer_k": 128}


def publish_prefill(tp: int, tokens: int, layers: int, backend: str, seed: int, fmt: tuple[str, str]) -> dict:
    """One rank's work: both routes over every layer, the cross-check of the routes, timings."""
    world = dist.get_world_size()
    p = world // tp
    # Two layouts on one buffer: the direct route's cache, then the all-gather route's.
    main_scale, indexer_scale = fmt
    one = pcp.CacheLayout(num_blocks=tokens // 64 + 1, num_layers=layers)
    layouts = [
        pcp.CacheLayout(one.num_blocks, layers, base=base, main_scale=main_scale, indexer_scale=indexer_scale)
        for base in (0, one.end)
    ]
    buf = ss.SymmetricBuffer(layouts[1].end, backend=backend)
    view = ss.pcp_view(buf, tp=tp)  # rank = pcp_rank * tp + tp_rank
    group, _ = dist.new_subgroups_by_enumeration([[k * tp + t for k in range(p)] for t in range(tp)])
    writers = {
        "direct": pcp.DirectKVWriter(view, layouts[0], route="direct"),
        "allgather": pcp.DirectKVWriter(view, layouts[1], route="allgather", group=group),
    }
    split = pcp.pcp_split(tokens, p)
    gen = torch.Generator().manual_seed(seed + view.ranks[0])  # the same prompt in a PCP group
    slot_mapping = torch.randperm(layouts[0].num_slots, generator=gen)[:tokens]
    prompt = {k: torch.randn(layers, tokens, w, generator=gen).to(torch.bfloat16) for k, w in SHAPES.items()}
    me = view.local_index
    local = {
        k: [split.local_rows(v[layer], me).to(buf.device).contiguous() for layer in range(layers)]
        for k, v in prompt.items()
    }
    batches = {name: w.prepare(split.local_slots(slot_mapping, me).to(buf.device)) for name, w in writers.items()}
    streams = buf.capabilities.streams  # GPUs: asynchronous launches, CUDA graphs
    sync = torch.cuda.synchronize if streams else (lambda: None)

    def prefill(name: str) -> None:  # a whole prefill: every layer, issued back to back
        w, b = writers[name], batches[name]
        for layer in range(layers):
            w.write(layer, local["kv_c"][layer], local["k_pe"][layer], local["indexer_k"][layer], b)

    def timed(fn, reps: int) -> float:  # median seconds per layer
        out = []
        for _ in range(reps):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - t0) / layers)
        return statistics.median(out)

    reps = 5 if streams else 1
    times = {f"{name}.eager": timed(lambda n=name: prefill(n), reps) for name in writers}
    if streams:  # the same prefill captured once, then replayed
        for name in writers:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefill(name)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            sync()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                prefill(name)
            times[f"{name}.graph"] = timed(graph.replay, reps)
            del graph
    sync()
    dist.barrier()
    same = all(
        torch.equal(layouts[0].layer_backing(buf, layer, r), layouts[1].layer_backing(buf, layer, r))
        for layer in range(layers)
        for r in view.ranks
    )
    out = {
        "rank": buf.rank,
        "view": list(view.ranks),
        "rows": split.tokens_per_rank,
        "identical": same,
        "times": times,
        "bytes": {k: w.bytes_per_layer(split.tokens_per_rank) for k, w in writers.items()},
        "backend": buf.backend,
    }
    for w in writers.values():
        w.fence.fence()  # nobody closes while a member still reads its replica
    buf.close()
    return out


FORMATS = {"current": "pow2,ue8m0", "legacy": "fp32,fp32"}


def parse_format(text: str) -> tuple[str, str]:
    """``MAIN,INDEXER`` (or ``current`` / ``legacy``) -> the two scale formats."""
    main_scale, _, indexer_scale = FORMATS.get(text, text).partition(",")
    if main_scale not in pcp.MAIN_SCALES or indexer_scale not in pcp.INDEXER_SCALES:
        raise argparse.ArgumentTypeError(
            f"--format takes MAIN,INDEXER with MAIN in {pcp.MAIN_SCALES} and INDEXER in "
            f"{pcp.INDEXER_SCALES}, or one of {sorted(FORMATS)}; got {text!r}"
        )
    return main_scale, indexer_scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pcp", type=int, default=None, help="ranks in a PCP group (default: WORLD_SIZE / tp under torchrun, else 2)"
    )
    parser.add_argument("--tp", type=int, default=1, help="TP ranks per PCP rank (default 1); world = tp * pcp")
    parser.add_argument(
        "--tokens", type=int, default=None, help="prompt tokens (default: 256 on the host backend, 16384 on GPUs)"
    )
    parser.add_argument("--layers", type=int, default=None, help="layers (default: 4 on the host, 61 on GPUs)")
    parser.add_argument(
        "--backend",
        choices=("auto", "host", "cuda"),
        default="auto",
        help="auto: cuda when this machine has tp*pcp GPUs, else host (CPU processes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--format",
        type=parse_format,
        default="pow2,ue8m0",
        help="cache format MAIN,INDEXER: main pow2|fp32, indexer ue8m0|fp32|mxfp8 (default pow2,ue8m0); "
        "'legacy' is fp32,fp32",
    )
    args = parser.parse_args(argv)
    if args.pcp is None:
        args.pcp = max(1, int(os.environ.get("WORLD_SIZE", 2 * args.tp)) // max(1, args.tp))
    world = args.tp * args.pcp
    if args.tp < 1 or args.pcp < 1:
        parser.error("--tp and --pcp must be at least 1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend if args.backend != "auto" else ("cuda" if gpus >= world else "host")
    if backend == "cuda" and gpus < world:
        parser.error(f"--backend cuda needs {world} GPUs (tp*pcp); this machine has {gpus}")
    tokens = args.tokens if args.tokens is not None else (16384 if backend == "cuda" else 256)
    layers = args.layers if args.layers is not None else (61 if backend == "cuda" else 4)
    main_process = is_main_process()
    if main_process:
        print(
            f"PCP{args.pcp} x TP{args.tp} on the {backend} backend: {tokens} prompt tokens, {layers} layers, "
            f"{world} ranks, cache format {','.join(args.format)}",
            flush=True,
        )
    t0 = time.perf_counter()
    results = run(
        publish_prefill,
        world,
        args.tp,
        tokens,
        layers,
        backend,
        args.seed,
        args.format,
        backend=backend,
        timeout_s=max(300.0, 2.0 * layers * world),
    )
    ok = all(r["identical"] for r in results)
    if not main_process:
        return 0 if ok else 1
    modes = ("eager", "graph") if backend == "cuda" else ("eager",)
    print(
        f"\n{'rank':>4s} {'PCP group':>10s} {'rows':>6s} {'mode':>6s} {'direct ms/layer':>16s} "
        f"{'allgather ms/layer':>19s} {'speedup':>8s} {'sent to peers, direct':>22s} {'allgather':>10s}"
    )
    for r in results:
        for mode in modes:
            d, a = r["times"][f"direct.{mode}"] * 1e3, r["times"][f"allgather.{mode}"] * 1e3
            print(
                f"{r['rank']:>4d} {str(r['view']):>10s} {r['rows']:>6d} {mode:>6s} {d:16.4f} {a:19.4f} "
                f"{a / d:7.2f}× {_kib(r['bytes']['direct']['sent_to_peers']):>22s} "
                f"{_kib(r['bytes']['allgather']['sent_to_peers']):>10s}"
            )
    print(
        f"\nroute cross-check (every replica identical between direct and all-gather + insert, every layer; "
        f"the same kernel, so not an oracle: tests/oracles.py is one): "
        f"{'OK' if ok else 'FAILED'}"
    )
    if backend == "host":
        print(
            "(host backend: kernels run in Triton's interpreter, so times show the mechanics, not GPU speed; "
            "see docs/performance.md for H200 numbers)"
        )
    else:
        print("(eager: a whole prefill issued layer by layer from Python; graph: the same prefill as one CUDA graph)")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
