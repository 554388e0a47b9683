"""The decode step of ``benchmarks/host.py``: 8 layers (a GEMM, then the fused all-reduce +
residual + RMS norm), 16 tokens, on 2 ranks sharing GPU 0 as a tensor-parallel pair would
(``SYMMSYNC_SHARE_GPUS=1``, gloo): eager, compiled, and compiled in a CUDA graph (replay), against
the same model with local torch ops in place of the all-reduce; each rank's bits checked against
its eager step, and the ranks' outputs against each other. ``host.py`` runs it (:func:`decode`, a
torchrun job of this file); rank 0 prints the JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import DECODE_STEPS, DECODE_TOKENS, HIDDEN, LAYERS, PORT, graphed, host_us  # noqa: E402


def decode_rank() -> None:
    """One rank of the decode step (run under torchrun by :func:`decode`); rank 0 prints the JSON."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    import symmsync as ss
    from symmsync import collectives as C

    dev = torch.device("cuda", 0)
    numel = 64 * HIDDEN
    buf = ss.SymmetricBuffer(C.workspace_bytes(numel, torch.bfloat16, world) + 4096, backend="cuda")
    ar = C.AllReduce(buf.view(list(range(world))), numel, torch.bfloat16, timeout_s=300)
    g = torch.Generator(dev).manual_seed(11 + rank)
    Ws = [
        (torch.randn(HIDDEN, HIDDEN, generator=g, device=dev) / HIDDEN**0.5).to(torch.bfloat16) for _ in range(LAYERS)
    ]
    gw = torch.Generator(dev).manual_seed(3)  # norm weights are replicated on every TP rank
    nw = [(torch.rand(HIDDEN, generator=gw, device=dev) + 0.5).to(torch.bfloat16) for _ in range(LAYERS)]

    def step(h, res):
        for i in range(LAYERS):
            h, res = ar(h @ Ws[i], residual=res, norm_weight=nw[i], eps=1e-6)
        return h, res

    def local(h, res):  # the same arithmetic with no communication
        for i in range(LAYERS):
            res = (h @ Ws[i]).float().add(res.float()).to(torch.bfloat16)
            hf = res.float()
            h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * nw[i].float()).to(torch.bfloat16)
        return h, res

    def inputs(i):
        gi = torch.Generator(dev).manual_seed(1000 * i + 17 * rank)
        gr = torch.Generator(dev).manual_seed(1000 * i)  # the residual is the same on every TP rank
        return tuple(torch.randn(DECODE_TOKENS, HIDDEN, generator=q, device=dev).to(torch.bfloat16) for q in (gi, gr))

    def bits(t):
        return t.view(torch.int16)

    def sync():
        torch.cuda.synchronize()
        dist.barrier()

    rng = random.Random(rank)
    report: dict = {}
    with torch.no_grad():
        ref = {i: tuple(t.clone() for t in step(*inputs(i))) for i in range(DECODE_STEPS)}
        sync()
        hs = [torch.empty_like(ref[1][0].cpu()) for _ in range(world)]
        dist.all_gather(hs, ref[1][0].cpu())
        report["ranks_same_bits"] = all(torch.equal(bits(hs[0]), bits(t)) for t in hs)
        cstep, clocal = torch.compile(step, fullgraph=True), torch.compile(local, fullgraph=True)
        bad = 0
        for i in range(DECODE_STEPS):
            if rank == 1 and rng.random() < 0.2:
                time.sleep(rng.random() * 0.01)
            h, res = cstep(*inputs(i))
            bad += not (torch.equal(bits(h), bits(ref[i][0])) and torch.equal(bits(res), bits(ref[i][1])))
        report["compiled_steps_not_eager_bits"] = bad
        sh, sr = inputs(0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                cstep(sh, sr)
        torch.cuda.current_stream().wait_stream(s)
        sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gh, gr = cstep(sh, sr)
        sync()
        bad = 0
        for i in range(DECODE_STEPS):
            a, b = inputs(i)
            sh.copy_(a)
            sr.copy_(b)
            if rank == 1 and rng.random() < 0.2:
                time.sleep(rng.random() * 0.01)
            graph.replay()
            torch.cuda.synchronize()
            bad += not (torch.equal(bits(gh), bits(ref[i][0])) and torch.equal(bits(gr), bits(ref[i][1])))
        report["graph_steps_not_eager_bits"] = bad
        lh, lr = inputs(0)
        local_replay = graphed(lambda: clocal(lh, lr))
        a, b = inputs(5)
        us = {}
        for name, fn in (
            ("eager", lambda: step(a, b)),
            ("compiled", lambda: cstep(a, b)),
            ("graph", graph.replay),
            ("local_eager", lambda: local(a, b)),
            ("local_compiled", lambda: clocal(a, b)),
            ("local_graph", local_replay),
        ):
            us[name] = host_us(fn, iters=30, reps=7, warmup=5, sync=sync)
        report["host_us_step"] = us
    out: list = [None] * world
    dist.all_gather_object(out, report)
    if rank == 0:
        print("DECODE " + json.dumps(out), flush=True)
    sync()
    buf.close()
    dist.destroy_process_group()


def decode() -> list | str:
    """The decode step on 2 ranks sharing GPU 0 (a torchrun job of this script)."""
    env = {**os.environ, "SYMMSYNC_SHARE_GPUS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(PORT + 1),
        os.path.abspath(__file__),
    ]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired:
        return "failed: the decode job ran past 420 s"
    for line in p.stdout.splitlines():
        if line.startswith("DECODE "):
            return json.loads(line[len("DECODE ") :])
    return f"failed: rc {p.returncode}: {(p.stdout + p.stderr)[-1500:]}"


if __name__ == "__main__":
    decode_rank()
