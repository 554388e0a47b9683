"""vLLM's piecewise layout: the decode step cut at the KV ops, the all-reduce and the fused norm
inside compiled pieces, bit for bit the eager loop's over 12 steps at world 2 with random delays
(50 at world 3 with the soaks, ``make test-soak``; 50 in the GPU run).

The decode step of examples/08_compiled_decode.py (per layer: the fused all-reduce + residual
add + RMS norm, the writer's KV write, an attention stand-in reading the local replica, a
fence), compiled with ``fullgraph=True`` and split by :mod:`piecewise` the way vLLM splits a
model: at the split names docs/inside-a-model.md gives vLLM (``symmsync::kv_write``,
``symmsync::fence``), every other subgraph compiled per batch shape, the splitting ops eager,
with a random delay before each of them on one rank. The oracle is the same loop run eagerly
from the same start: every step's output and the whole cache at the end, the same bits. Host
backend at worlds 2 and 3; the GPU run (pieces in CUDA graphs, ranks sharing a GPU) is in
tests/gpu/test_gpu_compile.py.
"""

import importlib.util
import random
import time
from pathlib import Path

import piecewise
import pytest
import torch
import torch.distributed as dist

from symmsync.testing import run

STEPS = 50  # the GPU run's and the soak's (world 3)
HOST_STEPS = {2: 12, 3: STEPS}  # the host backend's, per world
_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "08_compiled_decode.py"


def example():
    spec = importlib.util.spec_from_file_location("compiled_decode", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def piecewise_against_eager(backend: str, steps: int, graphs: bool) -> dict:
    torch._dynamo.reset()  # as in a fresh process: the host ranks serve other tests too (tests/conftest.py)
    ex = example()
    model = ex.Model(backend, steps)
    rank, world = dist.get_rank(), dist.get_world_size()
    late = random.Random(rank)

    def delay():
        if rank == world - 1:
            time.sleep(late.uniform(0, 0.005))

    seen = []
    compiled = torch.compile(ex.decode_step, fullgraph=True, backend=piecewise.backend(graphs, delay, seen))
    with torch.no_grad():
        got, got_caches = ex.decode_loop(model, compiled, steps)
        want, want_caches = ex.decode_loop(model, ex.decode_step, steps)
    split = seen[0]
    pieces = [m for m in split.children() if isinstance(m, piecewise.Piece)]
    inside = [str(n.target) for p in pieces for n in p.gm.graph.nodes if n.op == "call_function"]
    between = [str(n.target) for m in split.children() if isinstance(m, piecewise.Between) for n in m.gm.graph.nodes]
    out = {
        "graphs": len(seen),
        "outputs": all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want)),
        "caches": all(torch.equal(a, b) for a, b in zip(got_caches, want_caches)),
        "in pieces": sorted({t.removesuffix(".default") for t in inside if t.startswith("symmsync.")}),
        "between": sorted({t.removesuffix(".default") for t in between if t.startswith("symmsync.")}),
        "piece calls": sum(p.calls for p in pieces),
    }
    model.writer.fence.fence()
    model.buf.close()
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.soak)])  # world 3: make test-soak (CI time)
def test_the_piecewise_decode_step_gives_the_eager_bits_at_every_step(host_ranks, world):
    steps = HOST_STEPS[world]
    for out in host_ranks(piecewise_against_eager, world, "host", steps, False, timeout_s=900):
        assert out["outputs"] and out["caches"], out
        assert out["graphs"] == 1  # one trace for every token count
        assert out["in pieces"] == ["symmsync.all_reduce_residual_rms_norm"], out
        assert out["between"] == ["symmsync.fence", "symmsync.kv_write"], out
        assert out["piece calls"] > steps  # the pieces ran on every step, each layer's


@pytest.mark.gpu
def test_on_the_gpu_the_pieces_in_cuda_graphs_give_the_eager_bits():
    """The same at world 2 on GPUs (ranks sharing one with ``SYMMSYNC_SHARE_GPUS=1``), each piece
    captured in a CUDA graph per batch shape and replayed, as vLLM's piecewise CUDA graphs are."""
    for out in run(piecewise_against_eager, 2, "cuda", STEPS, True, backend="cuda", timeout_s=900):
        assert out["outputs"] and out["caches"], out
        assert out["in pieces"] == ["symmsync.all_reduce_residual_rms_norm"], out
        assert out["piece calls"] > STEPS
