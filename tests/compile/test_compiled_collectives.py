"""The collectives inside ``torch.compile(fullgraph=True)``: the same calls, bit for bit.

``ar(x)``, ``ar(x, residual=r, norm_weight=w, eps=e)``, ``ag(x)`` and ``rs(x)`` in a
compiled decode step trace to the ``symmsync::`` custom ops (symmsync/collectives/torch_ops.py)
and must give the bits the eager calls give, on every member:

* 14 decode steps at world 2 (every token count twice) and 50 at world 3 (with the soaks,
  ``make test-soak``), with Inductor and with aot_eager, token counts changing
  from step to step, a random delay on the last member before some steps; each step runs the
  compiled function, then the same step eagerly on the same objects (the oracle: the eager
  path, whose own oracle is tests/collectives/test_collectives.py), and compares the bytes.
  The token count is a dynamic dimension: one compilation serves every count (Dynamo's
  frame counter);
* a graph that drops a collective's result still makes the call (its members wait for it);
* a bad input inside a compiled graph fails all or nothing, as an eager call does;
* ``out=`` under compile raises ConfigError while tracing, on every rank;
* the symmetric input (``ar.input(n)``) is a plain input: filled outside the graph or inside
  it, the result is the eager one.
"""

import random
import time

import pytest
import torch
import torch._dynamo.testing
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C

HIDDEN = 48  # a multiple of 2 and 3: every token count splits into one chunk per member
MAX_TOKENS = 8
TOKENS = (2, 3, 5, 8, 4, 6, 7)  # never 1: Dynamo specializes sizes 0 and 1
STEPS = {2: 14, 3: 50}  # decode steps per world: every token count twice at world 2; the soak's 50 at world 3


def _collectives(timeout_s=120.0):
    """The three collectives over every rank. The budget covers a peer still compiling its graph."""
    world = dist.get_world_size()
    per = C.workspace_bytes(MAX_TOKENS * HIDDEN, torch.float32, world)
    buf = ss.SymmetricBuffer(3 * per, backend="host")
    view = buf.view(list(range(world)))
    ar = C.AllReduce(view, MAX_TOKENS * HIDDEN, torch.float32, offset=0, channel=0, timeout_s=timeout_s)
    ag = C.AllGather(view, MAX_TOKENS * HIDDEN, torch.float32, offset=per, channel=1, timeout_s=timeout_s)
    rs = C.ReduceScatter(view, MAX_TOKENS * HIDDEN, torch.float32, offset=2 * per, channel=2, timeout_s=timeout_s)
    return buf, ar, ag, rs


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------- decode steps against eager
def decode_steps(backend: str, steps: int) -> tuple[list[int], int]:
    """(the steps whose compiled outputs differ from eager's, Dynamo's compilations)."""
    torch._dynamo.reset()  # as in a fresh process: these ranks serve other tests too (tests/conftest.py)
    buf, ar, ag, rs = _collectives()
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(x, residual, weight):
        # Elementwise work exact in float32 (a product by a power of two, then a sum), so that
        # a fused kernel and eager agree bit for bit whether or not the compiler contracts it.
        h = ar(x * 2.0 + 1.0)
        y, residual = ar(h, residual=residual, norm_weight=weight, eps=1e-6)
        return h, y, residual, ag(y), rs(residual)

    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    delays = random.Random(7)
    wrong = []
    for i in range(steps):
        tokens = TOKENS[i % len(TOKENS)]
        g = torch.Generator().manual_seed(1000 * i + rank)
        x, residual = torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, HIDDEN, generator=g)
        weight = torch.randn(HIDDEN, generator=g)
        if i == 0:  # the token count: one graph for every count
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(residual, 0)
        pause = delays.random() < 0.3
        if rank == world - 1 and pause:
            time.sleep(delays.uniform(0.0, 0.02))
        got = compiled(x, residual, weight)
        want = step(x, residual, weight)
        if not all(same_bytes(a, b) for a, b in zip(got, want, strict=True)):
            wrong.append(i)
    dist.barrier()
    buf.close()
    return wrong, counter.frame_count


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.soak)])  # world 3: make test-soak (CI time)
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_decode_steps_give_the_eager_bits_and_compile_once(host_ranks, backend, world):
    for wrong, compilations in host_ranks(decode_steps, world, backend, STEPS[world], timeout_s=600):
        assert wrong == []
        assert compilations == 1


# ---------------------------------------------------------------------- what a graph may not lose
def dropped_result(backend: str) -> float:
    """Rank 1's compiled function drops its all-reduce's result; rank 0 waits for that call."""
    torch._dynamo.reset()
    buf, ar, _ag, _rs = _collectives(timeout_s=60.0)
    rank = dist.get_rank()

    def step(x):
        total = ar(x)
        return total + 1.0 if rank == 0 else x + 1.0  # rank 1's graph has no use for the sum

    got = torch.compile(step, fullgraph=True, backend=backend)(torch.full((16,), float(rank + 1)))
    dist.barrier()
    buf.close()
    return float(got[0])


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])  # each eliminates dead code its own way
def test_a_graph_that_drops_a_result_still_makes_the_call(host_ranks, backend):
    assert host_ranks(dropped_result, 2, backend, timeout_s=600) == [4.0, 3.0]  # rank 0: (1 + 2) + 1; rank 1: 2 + 1


def bad_input_in_a_graph() -> str:
    """Rank 1 passes more elements than the workspace holds, inside a compiled call."""
    torch._dynamo.reset()
    buf, ar, _ag, _rs = _collectives()
    rank = dist.get_rank()
    compiled = torch.compile(lambda x: ar(x) * 2.0, fullgraph=True, backend="aot_eager")
    x = torch.ones(MAX_TOKENS * HIDDEN + (1 if rank == 1 else 0))
    try:
        compiled(x)
        seen = "returned"
    except ss.SymmSyncError as e:
        seen = type(e).__name__
    dist.barrier()
    buf.close()
    return seen


def test_a_bad_input_inside_a_graph_fails_on_every_member(host_ranks):
    assert host_ranks(bad_input_in_a_graph, 2, timeout_s=600) == ["PeerRefused", "InputError"]


def out_under_compile() -> list[str]:
    """``out=`` and ``residual_out=`` in a compiled function: what tracing raises, per call."""
    torch._dynamo.reset()
    buf, ar, ag, _rs = _collectives()
    x, w = torch.ones(2, HIDDEN), torch.ones(HIDDEN)
    calls = {
        "ar": lambda: ar(x, out=torch.empty_like(x)),
        "fused": lambda: ar(x, residual=x, norm_weight=w, residual_out=torch.empty_like(x)),
        "half epilogue": lambda: ar(x, residual=x),
        "ag": lambda: ag(x, out=torch.empty(x.numel() * dist.get_world_size())),
    }
    seen = []
    for call in calls.values():
        try:
            torch.compile(call, fullgraph=True, backend="eager")()
            seen.append("compiled")
        except Exception as e:  # noqa: BLE001 - Dynamo reports the ConfigError it traced as Unsupported
            seen.append(f"{type(e).__name__}: {'ConfigError' in str(e) and 'under torch.compile' in str(e)}")
    dist.barrier()
    buf.close()
    return seen


def test_out_under_compile_raises_config_error_while_tracing(host_ranks):
    for seen in host_ranks(out_under_compile, 2, timeout_s=600):
        assert seen == ["Unsupported: True"] * 4


def symmetric_input_in_a_graph() -> list[bool]:
    """``ar.input(n)`` passed to a compiled function: filled outside it, and filled inside it."""
    torch._dynamo.reset()
    buf, ar, _ag, _rs = _collectives()
    rank, n = dist.get_rank(), 2 * HIDDEN
    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    want = ar(x.clone())  # eager, copied in

    def fill_and_reduce(t, x):
        t.copy_(x)  # functionalized: the op receives the copy, which it copies in
        return ar(t)

    t = ar.input(n)
    t.copy_(x)
    filled_outside = torch.compile(lambda t: ar(t), fullgraph=True, backend="aot_eager")(t)
    filled_inside = torch.compile(fill_and_reduce, fullgraph=True, backend="aot_eager")(ar.input(n), x)
    seen = [same_bytes(filled_outside, want), same_bytes(filled_inside, want), same_bytes(ar.input(n), x)]
    dist.barrier()
    buf.close()
    return seen


def test_the_symmetric_input_is_a_plain_input_under_compile(host_ranks):
    assert host_ranks(symmetric_input_in_a_graph, 2, timeout_s=600) == [[True, True, True]] * 2
