"""symmsync.moe inside ``torch.compile(fullgraph=True)``: the same layers, bit for bit.

A compiled MoE layer (dispatch, an elementwise expert, combine) traces to the
``symmsync::moe_dispatch`` and ``symmsync::moe_combine`` ops (symmsync/moe/torch_ops.py); each layer
runs compiled, then eagerly on the same dispatcher (the oracle: the eager path, whose own oracle
is tests/moe/test_moe.py), and the outputs must have the same bits, on every member, with aot_eager
and with Inductor. The graph compiles once (Dynamo's frame counter), with no graph break.
Every tensor argument may be an ``nn.Parameter`` (a tensor), eagerly and compiled, under
``no_grad``: the layer's results are the oracle's (``moe_oracle.py``).
"""

import pytest
import routings
import torch
import torch._dynamo.testing
import torch.distributed as dist
from test_moe import compare, experts, gathered, make

E, M, H, K = 4, 4, 32, 2


def compiled_layers(backend, fp8):
    torch._dynamo.reset()
    world, me = dist.get_world_size(), dist.get_rank()
    hidden = 128 if fp8 else H
    buf, disp = make(E, M, hidden, torch.bfloat16, K, fp8=fp8)
    scale = torch.arange(1, disp.local_experts + 1, dtype=torch.float32)[:, None, None]

    def step(x, ids, w):
        recv, counts, handle = disp.dispatch(x, ids)
        rows = recv[0].float() * recv[1].repeat_interleave(128, dim=-1) if fp8 else recv.float()
        out = (rows * scale).to(torch.bfloat16)
        return disp.combine(out, w, handle), counts

    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    wrong = []
    try:
        for i in range(4):
            x, ids, w = routings.routing(routings.KINDS[i], me, world, E, M, hidden, K, torch.bfloat16, 40 + i)
            got, got_counts = compiled(x, ids, w)
            want, want_counts = step(x, ids, w)
            if not (
                torch.equal(got.view(torch.int16), want.view(torch.int16)) and torch.equal(got_counts, want_counts)
            ):
                wrong.append(f"layer {i} differs from the eager layer")
    finally:
        buf.close()
    return wrong, counter.frame_count


@pytest.mark.parametrize(
    "backend, fp8",
    # Inductor: make test-soak (CI time); the GPU suite compiles with it (tests/gpu/test_gpu_moe.py)
    [("aot_eager", False), pytest.param("inductor", False, marks=pytest.mark.soak), ("aot_eager", True)],
)
def test_a_compiled_moe_layer_gives_the_eager_layers_bits(host_ranks, backend, fp8):
    results = host_ranks(compiled_layers, 2, backend, fp8, timeout_s=600)
    assert [r[0] for r in results] == [[], []], results
    assert all(r[1] >= 1 for r in results), results


def parameters(compiled):
    """A layer whose every tensor argument is an ``nn.Parameter`` (the int64 ids one that needs no
    grad), under ``no_grad``: what ``accepts()`` says, and the results' differences from the oracle."""
    torch._dynamo.reset()
    world, me = dist.get_world_size(), dist.get_rank()
    buf, disp = make(E, M, H, torch.bfloat16, K)

    def compile(fn):
        return torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn

    dispatch, combine = compile(disp.dispatch), compile(disp.combine)

    def call(x, ids, w):  # the experts' output a Parameter too, made between the two calls
        recv, counts, handle = dispatch(x, ids)
        return recv, counts, handle, combine(torch.nn.Parameter(experts(disp, recv)), w, handle)

    wrong = []
    try:
        with torch.no_grad():
            for i in range(2):
                x, ids, w = routings.routing(routings.KINDS[i], me, world, E, M, H, K, torch.bfloat16, 60 + i)
                px, pw = torch.nn.Parameter(x), torch.nn.Parameter(w)
                pids = torch.nn.Parameter(ids, requires_grad=False)  # int64: no grad
                if not disp.accepts(px, pids):
                    wrong.append(f"layer {i}: accepts() refused Parameters")
                got = call(px, pids, pw)
                wrong += compare(disp, i, got, (gathered(x), gathered(ids), gathered(w)), me)
    finally:
        buf.close()
    return wrong


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parameters_are_tensors_to_dispatch_and_combine(host_ranks, compiled):
    assert host_ranks(parameters, 2, compiled, timeout_s=300) == [[], []]
