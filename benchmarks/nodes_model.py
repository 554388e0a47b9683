"""Past one node, on paper: predicted times of the collectives and the PCP writer at 1 to 8 nodes.

A model, not a measurement: no multi-node machine ran symmsync. It takes the one-node
figures measured on H200s (the committed result files below) and adds, for every
inter-node step, the network's latency and bandwidth as assumed in ``ASSUMED``. Run
anywhere (no GPU, no torch)::

    python benchmarks/nodes_model.py [--out benchmarks/results]

It prints the tables, and writes ``nodes_model.json`` (inputs with their sources, the
assumptions, every predicted row) and ``nodes_model.png`` into ``--out``.

Inputs (measured):

* ``fence_h200x2.json`` (2x H200, NV18): ``symmsync_fence.graph``, one fence in graph
  replay: the cost of each intra-node synchronization step; ``empty_symmsync_launcher.graph``:
  one kernel node; ``nccl_allreduce.eager``: an NCCL all-reduce of one int on the same two
  GPUs, issued from the host and waited for, the fixed cost of one off-node step (every
  off-node step is a host-issued torch.distributed call, ``symmsync.spanning.exchange.OffNode``)
  without its network hops.
* ``pcp_kv_h200x2.json`` (2x H200): per tokens/rank, the PCP2 writer in graph replay
  (``direct.graph``: the writer and its fence), the local insert alone (``local_insert.graph``,
  the same kernel with one replica) and NCCL all-gather + insert (``allgather.graph``).

The model (``g`` GPUs per node, ``n`` nodes, per-rank message ``M`` bytes; times add up, no
overlap between steps; ``hop`` is ``ASSUMED["net_hop_us"]`` for steps of at most 64 KiB and
``ASSUMED["net_hop_simple_us"]`` above):

* an intra-node step: a kernel node + a fence + its bytes over NVLink (``nvlink_GBps``);
* an inter-node step: the host-issued call's fixed cost + ``hop`` per ring step + its bytes
  over the network (``net_GBps``, one NIC per GPU); a collective's call crosses nodes once:
  its header (64 bytes) travels in front of its data in a frame of fixed size, compared
  after the exchange (the model's calls are at ``max_numel``, so a frame is header + data);
* all-reduce across nodes, as ``symmsync.collectives.spanning`` runs it: reduce-scatter in the
  node (``(g-1)/g M`` over NVLink), an all-gather of each node's partial chunk ``M/g`` among
  the GPUs at one node position (``n-1`` hops, ``(n-1) M/g`` bytes; every rank then sums the
  ``n`` partials in node order), all-gather in the node; on one node the better of one-shot
  (``(g-1) M`` read, one fence) and two-shot (``2 (g-1)/g M``, two fences); the fused norm
  adds one read and one write of ``M`` at HBM speed (``hbm_GBps``);
* all-gather (``M`` in, ``g n M`` out): all-gather of ``M`` among the node positions, then the
  node's all-gather of ``n M``; reduce-scatter (``M`` out): the node's reduce-scatter to
  ``n M``, then an all-gather of those ``n M`` among the node positions (``(n-1) n M`` bytes:
  each rank receives every node's partial of its ``n`` chunks and sums them in node order);
* the writer, ``p`` PCP members per node, ``T`` tokens per member: the direct route across
  nodes is an all-gather of the compact KV (1408 bytes a token) among the node positions,
  then the direct kernel with ``n T`` rows into the node's ``p`` replicas, timed as the
  measured kernel at that row count (``direct.graph`` for ``p = 2``, ``local_insert.graph``
  for ``p = 1``; per-token rate of the largest measured count beyond it); the all-gather
  route gathers every member's ``T`` rows (``p n - 1`` ring steps at network speed), then
  inserts ``p n T`` rows locally. On one node the measured figures stand as they are.
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
FENCE, WRITER = "fence_h200x2.json", "pcp_kv_h200x2.json"

#: What the model assumes, and where each number comes from.
ASSUMED = {
    "gpus_per_node": 8,  # an HGX H200 node
    "nvlink_GBps": 450.0,  # H200 NVLink: 900 GB/s per GPU both ways (NVIDIA's H200 specification), one way
    "net_GBps": 50.0,  # one 400 Gb/s InfiniBand NDR NIC per GPU
    "hbm_GBps": 4800.0,  # H200 HBM3e (NVIDIA's H200 specification)
    # Per network step of a ring: NCCL's own latency model (src/graph/tuning.cc, hwLat[NET][Ring]:
    # LL 2.7 us, Simple 9.6 us, in the version read: NVIDIA/nccl 01afd20).
    "net_hop_us": 2.7,
    "net_hop_simple_us": 9.6,
    "small_step_bytes": 64 << 10,  # up to here a step is latency-bound (NCCL's LL protocol)
    "compact_bytes_per_token": 1408,  # bf16 kv_c 512 + k_pe 64 + indexer K 128
}
NODES = (1, 2, 4, 8)
SIZES = (64 << 10, 1 << 20, 16 << 20)
TOKENS = (4096, 32768)


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def inputs() -> dict:
    """The measured one-node figures, each with the file and key it comes from."""
    fence = load(FENCE)["results_us"]
    writer = {row["tokens_per_rank"]: row for row in load(WRITER)["rows"]}
    return {
        "fence_us": fence["symmsync_fence.graph"],
        "kernel_node_us": fence["empty_symmsync_launcher.graph"],
        "nccl_call_us": fence["nccl_allreduce.eager"],
        "writer_direct_us": {t: r["direct.graph"] for t, r in writer.items()},
        "writer_local_us": {t: r["local_insert.graph"] for t, r in writer.items()},
        "writer_allgather_us": {t: r["allgather.graph"] for t, r in writer.items()},
    }


def _us(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e3)  # GB/s = 1e3 bytes per µs


def _hop(step_bytes: float) -> float:
    small = step_bytes <= ASSUMED["small_step_bytes"]
    return ASSUMED["net_hop_us"] if small else ASSUMED["net_hop_simple_us"]


def intra(m: dict, nbytes: float, fences: int = 1) -> float:
    """One symmsync kernel in the node: its node, its fences, its bytes over NVLink."""
    return m["kernel_node_us"] + fences * m["fence_us"] + _us(nbytes, ASSUMED["nvlink_GBps"])


HEADER_BYTES = 64  # a call header, in front of its data across nodes: 8 int64 words (collectives/spanning.py)


def inter(m: dict, steps: int, nbytes: float, step_bytes: float) -> float:
    """One host-issued torch.distributed (NCCL) call among one GPU per node: ``steps`` ring steps."""
    if steps == 0:
        return 0.0
    return m["nccl_call_us"] + steps * _hop(step_bytes) + _us(nbytes, ASSUMED["net_GBps"])


def all_reduce(m: dict, n: int, size: int) -> float:
    g = ASSUMED["gpus_per_node"]
    if n == 1:
        return min(intra(m, (g - 1) * size), intra(m, 2 * (g - 1) / g * size, fences=2))
    frame = size / g + HEADER_BYTES
    return 2 * intra(m, (g - 1) / g * size) + inter(m, n - 1, (n - 1) * frame, frame)


def fused_norm(m: dict, n: int, size: int) -> float:
    return all_reduce(m, n, size) + _us(2 * size, ASSUMED["hbm_GBps"])


def all_gather(m: dict, n: int, size: int) -> float:
    g = ASSUMED["gpus_per_node"]
    frame = size + HEADER_BYTES if n > 1 else size
    return inter(m, n - 1, (n - 1) * frame, frame) + intra(m, (g - 1) * n * size)


def reduce_scatter(m: dict, n: int, size: int) -> float:
    """``size``: the output per rank (the input is ``g n`` times it)."""
    g = ASSUMED["gpus_per_node"]
    frame = n * size + HEADER_BYTES
    return intra(m, (g - 1) * n * size) + inter(m, n - 1, (n - 1) * frame, frame)


def kernel_at(measured: dict, rows: int) -> float:
    """The measured kernel time at ``rows`` rows; past the largest count, its per-row rate."""
    if rows in measured:
        return measured[rows]
    top = max(measured)
    return measured[top] * rows / top


def writer(m: dict, n: int, per_node: int, tokens: int) -> dict:
    """Per layer, µs: the direct route (across nodes: direct in the node, all-gather between) and
    the all-gather route, for ``per_node`` PCP members per node and ``tokens`` per member."""
    compact = tokens * ASSUMED["compact_bytes_per_token"]
    kernel = m["writer_direct_us"] if per_node == 2 else m["writer_local_us"]
    members = n * per_node
    if n == 1:
        direct = kernel[tokens]
        gathered = m["writer_allgather_us"][tokens] if per_node == 2 else m["writer_local_us"][tokens]
    else:
        direct = inter(m, n - 1, (n - 1) * compact, compact) + kernel_at(kernel, n * tokens)
        ring = m["nccl_call_us"] + (members - 1) * _hop(compact)
        gathered = ring + _us((members - 1) * compact, ASSUMED["net_GBps"])
        gathered += kernel_at(m["writer_local_us"], members * tokens)
    return {
        "nodes": n,
        "pcp_per_node": per_node,
        "tokens_per_rank": tokens,
        "direct_us": direct,
        "allgather_us": gathered,
        "off_node_bytes": (n - 1) * compact,
        "off_node_MB": (n - 1) * compact / 1e6,
    }


def model() -> dict:
    m = inputs()
    collectives = []
    for size in SIZES:
        for n in NODES:
            collectives.append(
                {
                    "nodes": n,
                    "bytes": size,
                    "all_reduce_us": all_reduce(m, n, size),
                    "fused_norm_us": fused_norm(m, n, size),
                    "all_gather_us": all_gather(m, n, size),
                    "reduce_scatter_us": reduce_scatter(m, n, size),
                }
            )
    writers = [writer(m, n, p, t) for p in (1, 2) for t in TOKENS for n in NODES]
    return {"inputs": m, "collectives": collectives, "writer": writers}


def table(result: dict) -> str:
    lines = [f"collectives, µs, {ASSUMED['gpus_per_node']} GPUs per node (M: bytes per rank)"]
    lines.append(f"{'M':>9} {'nodes':>5} {'all-reduce':>10} {'fused norm':>10} {'all-gather':>10} {'red-scat':>10}")
    for r in result["collectives"]:
        lines.append(
            f"{r['bytes']:>9} {r['nodes']:>5} {r['all_reduce_us']:>10.1f} {r['fused_norm_us']:>10.1f} "
            f"{r['all_gather_us']:>10.1f} {r['reduce_scatter_us']:>10.1f}"
        )
    lines.append("PCP writer, µs per layer (1 node: measured; more: model)")
    lines.append(f"{'pcp/node':>8} {'tokens':>6} {'nodes':>5} {'direct':>8} {'allgather':>9} {'off-node MB':>11}")
    for r in result["writer"]:
        lines.append(
            f"{r['pcp_per_node']:>8} {r['tokens_per_rank']:>6} {r['nodes']:>5} {r['direct_us']:>8.1f} "
            f"{r['allgather_us']:>9.1f} {r['off_node_MB']:>11.2f}"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for size in SIZES:
        rows = [r for r in result["collectives"] if r["bytes"] == size]
        left.plot(NODES, [r["all_reduce_us"] for r in rows], marker="o", label=f"all-reduce {size >> 10} KiB")
    left.set(xscale="log", yscale="log", xlabel="nodes (8 GPUs each)", ylabel="µs (model)", xticks=NODES)
    left.set_xticklabels([str(n) for n in NODES])
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_title("Hierarchical all-reduce (1 node: model from the measured fence)")
    left.legend()
    for p in (1, 2):
        for route, style in (("direct", "-"), ("allgather", "--")):
            rows = [r for r in result["writer"] if r["pcp_per_node"] == p and r["tokens_per_rank"] == TOKENS[-1]]
            right.plot(NODES, [r[f"{route}_us"] for r in rows], style, marker="o", label=f"{route}, {p} PCP/node")
    right.set(xscale="log", yscale="log", xlabel="nodes", ylabel="µs per layer", xticks=NODES)
    right.set_xticklabels([str(n) for n in NODES])
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_title(f"PCP writer, {TOKENS[-1]} tokens/rank (1 node measured, 2× H200)")
    right.legend()
    fig.suptitle("A model, not a measurement: 1-node inputs from fence_h200x2.json and pcp_kv_h200x2.json")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    result = model()
    print(table(result))
    machine = load(FENCE)["machine"]
    payload = {
        "what": "a model, not a measurement: predicted times past one node from 1-node H200 measurements",
        "machine": {
            "model_of": f"{ASSUMED['gpus_per_node']} H200 per node, NVLink in the node, one NIC per GPU",
            "inputs_measured_on": f"{machine['gpu_count']}x {machine['gpus'][0]} ({machine['link_gpu0_gpu1']}), "
            f"host {machine['host']}, {machine['date']}",
        },
        "sources": {"fence_us": FENCE, "kernel_node_us": FENCE, "nccl_call_us": FENCE, "writer": WRITER},
        "assumed": ASSUMED,
        "units": "µs; bytes",
        **result,
        "table": table(result),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "nodes_model.json"), "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.write("\n")
    plot(result, os.path.join(args.out, "nodes_model.png"))


if __name__ == "__main__":
    main()
