"""A compiled decode step with the all-reduce and the fused norm, in CUDA graphs (GPUs).

Marker ``gpu``: skipped where fewer than 2 GPUs exist, unless ``SYMMSYNC_SHARE_GPUS=1``.
The step (an all-reduce, then the fused all-reduce + residual + RMS norm) is compiled
with ``fullgraph=True`` and run 1000 times, (a) under ``mode="reduce-overhead"``
(torch's own CUDA graphs) and (b) captured by hand in a ``torch.cuda.graph`` and
replayed; every 100 steps its outputs are compared, bit for bit, with the same step run
eagerly on the same inputs (the eager path is tested against a torch oracle in
test_gpu_collectives.py), and the members' outputs with each other.
"""

import helpers
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2
TOKENS, HIDDEN = 8, 1024
STEPS, CHECK_EVERY = 1000, 100


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compiled_steps(mode):
    """Rank function: (steps checked, steps whose outputs differ from eager, steps where members differ)."""
    numel = TOKENS * HIDDEN
    buf = ss.SymmetricBuffer(C.workspace_bytes(numel, torch.bfloat16, WORLD), backend="cuda")
    ar = C.AllReduce(buf.view(list(range(WORLD))), numel, torch.bfloat16)
    dev, rank = buf.device, dist.get_rank()
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator(dev).manual_seed(7), device=dev)).to(torch.bfloat16)

    def step(x, r):
        h = ar(x * 2)
        return ar(h, residual=r, norm_weight=w, eps=1e-6)

    def inputs(i):
        g = torch.Generator(dev).manual_seed(1000 * i + rank)
        x = torch.randn(TOKENS, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
        r = torch.randn(TOKENS, HIDDEN, generator=torch.Generator(dev).manual_seed(i), device=dev).to(torch.bfloat16)
        return x, r

    x_s, r_s = (t.clone() for t in inputs(0))
    if mode == "reduce-overhead":
        compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")

        def run_step():
            y, nr = compiled(x_s, r_s)
            return y.clone(), nr.clone()  # the next replay reuses the graph's outputs
    else:
        compiled = torch.compile(step, fullgraph=True)
        y_s, nr_s = torch.empty_like(x_s), torch.empty_like(x_s)

        def body():
            y, nr = compiled(x_s, r_s)
            y_s.copy_(y)
            nr_s.copy_(nr)

        graph = helpers.capture(body)

        def run_step():
            graph.replay()
            return y_s.clone(), nr_s.clone()

    checked = wrong = split = 0
    for i in range(1, STEPS + 1):
        x, r = inputs(i)
        x_s.copy_(x)
        r_s.copy_(r)
        got = run_step()
        if i % CHECK_EVERY == 0:
            want = step(x, r)  # eager: not compiling, the plain path
            torch.cuda.synchronize()
            checked += 1
            wrong += int(not all(_same_bits(a, b) for a, b in zip(got, want)))
            mine = torch.cat([t.view(torch.uint8).flatten() for t in got])
            everyone = [torch.empty_like(mine) for _ in range(WORLD)]
            dist.all_gather(everyone, mine)
            split += int(not all(torch.equal(e, everyone[0]) for e in everyone))
    ar.synchronize()
    dist.barrier()
    buf.close()
    return checked, wrong, split


@pytest.mark.parametrize("mode", ["reduce-overhead", "manual-graph"])
def test_a_compiled_decode_step_in_cuda_graphs_matches_eager_every_100_steps(mode):
    for checked, wrong, split in run(compiled_steps, WORLD, mode, backend="cuda", timeout_s=600):
        assert (checked, wrong, split) == (STEPS // CHECK_EVERY, 0, 0), (checked, wrong, split)
