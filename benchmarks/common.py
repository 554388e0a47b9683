"""Shared pieces of the benchmark scripts: timing, machine description, result files."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_worker(rank: int, world: int, port: int) -> torch.device:
    """One process per GPU: select the GPU and join an NCCL group on 127.0.0.1."""
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    return dev


def sync_all() -> None:
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def eager_us(fn: Callable[[], None], iters: int, reps: int, warmup: int = 50, host_only: bool = False) -> float:
    """Median over ``reps`` of the wall time per call of ``iters`` back-to-back calls.

    With ``host_only`` the clock stops when the calls return, without waiting for the
    GPU: what an eager caller spends issuing the work, with the GPU running behind it
    (the launch queue is far deeper than one call's launches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync_all()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if not host_only:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()  # host_only: the GPU catches up outside the clock
    return statistics.median(times)


def graph_us(fn: Callable[[], None], iters: int, reps: int) -> float:
    """Median over ``reps`` of the time per call of a CUDA graph holding ``iters`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    sync_all()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()  # upload and warm up
    times = []
    for _ in range(reps):
        sync_all()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters * 1e6)
    del g
    return statistics.median(times)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict:
    """What ran the benchmark: GPUs, link, driver, library versions, the command."""
    info = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "cuda_bindings": _version("cuda-bindings"),
        "gpu_count": torch.cuda.device_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.split()
        info["driver"] = out[0] if out else "unknown"
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
        m = re.search(r"GPU0\s+X\s+(\S+)", topo)
        info["link_gpu0_gpu1"] = m.group(1) if m else "unknown"
    except (OSError, subprocess.SubprocessError):
        info["driver"] = "unknown"
    return info


def slug(info: dict) -> str:
    name = info["gpus"][0] if info["gpus"] else "cpu"
    name = re.sub(r"[^a-z0-9]+", "", name.lower().replace("nvidia", ""))
    return f"{name}x{info['gpu_count']}"


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.write("\n")


def add_layout_args(parser) -> None:
    """``--world`` (GPUs, one process each) and ``--tp`` (the PCP size is world / tp)."""
    parser.add_argument("--world", type=int, default=2, help="GPUs (one process each)")
    parser.add_argument("--tp", type=int, default=1, help="TP size; the PCP views span world / tp ranks")


def spawn(worker: Callable, args, script: str) -> None:
    """Check ``--world``/``--tp`` against this machine, then run ``worker(rank, world, args)`` on every GPU."""
    world, tp, n = args.world, args.tp, torch.cuda.device_count()
    if world < 2 or tp < 1 or world % tp or world // tp < 2:
        sys.exit(f"--world {world} --tp {tp}: need world >= 2 divisible by tp, with world / tp >= 2")
    if n < world:
        sys.exit(f"{script} --world {world} needs {world} GPUs; this machine has {n}")
    mp.spawn(worker, args=(world, args), nprocs=world, join=True)


def pcp_group(world: int, tp: int):
    """This rank's PCP subgroup as a torch.distributed group (rank = pcp_rank·tp + tp_rank)."""
    if tp == 1:
        return dist.group.WORLD
    groups = [[k * tp + t for k in range(world // tp)] for t in range(tp)]
    return dist.new_subgroups_by_enumeration(groups)[0]
