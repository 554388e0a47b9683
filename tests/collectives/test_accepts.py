"""Asking before calling: ``accepts()`` is False exactly when the call raises an input error.

Host backend, world 2. For each case of a sweep (both ranks pass the same arguments, so that a
good call completes and a bad one fails on each rank by itself), a fresh buffer and object:
the predicate's answer, then the call's outcome. The oracle is the call itself: ``accepts()``
must be False exactly where the call raised ``InputError``, True where it returned (the
writer's: tests/pcp/test_pcp_accepts.py). Then docs/inside-a-model.md's communicator pattern
(``ar(x)`` where ``ar.accepts(x)``, the runtime's own path elsewhere), eager and compiled
with ``fullgraph=True``: the members' sum where the input fits, the fallback's mark where it
does not, and the fast path still working after them. And docs/inside-a-model.md's
``DecoderLayer``, whose norm weight is an ``nn.Parameter``: a Parameter is a tensor (eager
and compiled, under ``no_grad``), its result the torch oracle's; a refusal names what differs.
"""

import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C

NUMEL, HIDDEN = 64, 16


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(2, timeout_s=240)


def _ar_case(name):
    """(args, kwargs, grad mode) of an all-reduce call named ``name``."""
    f32 = torch.ones(NUMEL)
    rows = torch.ones(NUMEL // HIDDEN, HIDDEN)
    cases = {
        "fits": ((f32,), {}, True),
        "other dtype, same bytes": ((torch.ones(2 * NUMEL, dtype=torch.bfloat16),), {}, True),
        "too many elements": ((torch.ones(NUMEL + 1),), {}, True),
        "not contiguous": ((torch.ones(2 * NUMEL)[::2],), {}, True),
        "int32": ((torch.ones(NUMEL, dtype=torch.int32),), {}, True),
        "not a tensor": (([1.0] * NUMEL,), {}, True),
        "requires grad, grad mode on": ((torch.ones(NUMEL, requires_grad=True),), {}, True),
        "requires grad, no_grad": ((torch.ones(NUMEL, requires_grad=True),), {}, False),
        "out of another size": ((f32, torch.empty(NUMEL - 1)), {}, True),
        "out of another dtype": ((f32, torch.empty(NUMEL, dtype=torch.float16)), {}, True),
        "out fits": ((f32, torch.empty(NUMEL)), {}, True),
        "unknown algorithm": ((f32,), {"algorithm": "three_shot"}, True),
        "fused fits": ((rows,), {"residual": torch.zeros_like(rows), "norm_weight": torch.ones(HIDDEN)}, True),
        "fused, residual of another shape": (
            (rows,),
            {"residual": torch.zeros(HIDDEN), "norm_weight": torch.ones(HIDDEN)},
            True,
        ),
        "fused, two-shot": (
            (rows,),
            {"residual": torch.zeros_like(rows), "norm_weight": torch.ones(HIDDEN), "algorithm": "two_shot"},
            True,
        ),
        "x a Parameter, no_grad": ((torch.nn.Parameter(torch.ones(NUMEL)),), {}, False),
        "x a Parameter, grad mode on": ((torch.nn.Parameter(torch.ones(NUMEL)),), {}, True),
        "fused, norm_weight a Parameter, no_grad": (
            (rows,),
            {"residual": torch.zeros_like(rows), "norm_weight": torch.nn.Parameter(torch.ones(HIDDEN))},
            False,
        ),
        "fused, norm_weight a Parameter, grad mode on": (
            (rows,),
            {"residual": torch.zeros_like(rows), "norm_weight": torch.nn.Parameter(torch.ones(HIDDEN))},
            True,
        ),
        "fused, norm_weight a Parameter that needs no grad": (
            (rows,),
            {"residual": torch.zeros_like(rows), "norm_weight": torch.nn.Parameter(torch.ones(HIDDEN), False)},
            True,
        ),
    }
    return cases[name]


AR_CASES = [
    "fits",
    "other dtype, same bytes",
    "too many elements",
    "not contiguous",
    "int32",
    "not a tensor",
    "requires grad, grad mode on",
    "requires grad, no_grad",
    "out of another size",
    "out of another dtype",
    "out fits",
    "unknown algorithm",
    "fused fits",
    "fused, residual of another shape",
    "fused, two-shot",
    "x a Parameter, no_grad",
    "x a Parameter, grad mode on",
    "fused, norm_weight a Parameter, no_grad",
    "fused, norm_weight a Parameter, grad mode on",
    "fused, norm_weight a Parameter that needs no grad",
]
#: The cases a call must take: the rest are refused.
AR_TAKEN = {
    "fits",
    "other dtype, same bytes",
    "requires grad, no_grad",
    "out fits",
    "fused fits",
    "x a Parameter, no_grad",
    "fused, norm_weight a Parameter, no_grad",
    "fused, norm_weight a Parameter that needs no grad",
}


def ask_then_call_all_reduce(names):
    out = []
    for name in names:
        args, kwargs, grad = _ar_case(name)
        buf = ss.SymmetricBuffer(C.workspace_bytes(NUMEL, torch.float32, 2), backend="host")
        ar = C.AllReduce(buf.view([0, 1]), NUMEL, torch.float32, timeout_s=60)
        with torch.set_grad_enabled(grad):
            said = ar.accepts(*args, **kwargs)
            try:
                ar(*args, **kwargs)
                got = "returned"
            except ss.SymmSyncError as e:
                got = type(e).__name__
        buf.close()
        out.append((name, said, got))
    return out


def test_an_all_reduce_accepts_exactly_what_it_does_not_refuse(pool):
    for rank, results in enumerate(pool.call(ask_then_call_all_reduce, AR_CASES)):
        for name, said, got in results:
            assert got in ("returned", "InputError"), (rank, name, got)
            assert said == (got == "returned"), (rank, name, said, got)
        # the calls that must be taken are (a Parameter is a tensor), the others are refused
        assert {name for name, said, _ in results if said} == AR_TAKEN, results


def ask_then_call_gather_and_scatter():
    out = []
    for op in (C.AllGather, C.ReduceScatter):
        for name, x in (
            ("fits", torch.ones(NUMEL)),
            ("odd size", torch.ones(NUMEL - 1)),
            ("f64", torch.ones(8).double()),
        ):
            buf = ss.SymmetricBuffer(4 * C.workspace_bytes(NUMEL, torch.float32, 2, "all_gather"), backend="host")
            c = op(buf.view([0, 1]), NUMEL, torch.float32, timeout_s=60)
            said = c.accepts(x)
            try:
                c(x)
                got = "returned"
            except ss.SymmSyncError as e:
                got = type(e).__name__
            buf.close()
            out.append((op.__name__, name, said, got))
    return out


def test_all_gather_and_reduce_scatter_accept_exactly_what_they_do_not_refuse(pool):
    for rank, results in enumerate(pool.call(ask_then_call_gather_and_scatter)):
        for op, name, said, got in results:
            assert got in ("returned", "InputError"), (rank, op, name, got)
            assert said == (got == "returned"), (rank, op, name, said, got)
        # an odd size is the reduce-scatter's refusal (not a multiple of 2 members), not the all-gather's
        assert [(op, said) for op, name, said, _ in results if name == "odd size"] == [
            ("AllGather", True),
            ("ReduceScatter", False),
        ]


#: The communicator pattern's inputs, in call order: the fast path, inputs it does not take,
#: then the fast path again (an input it refused never reached the call, so nothing failed).
COMMUNICATOR_INPUTS = (
    ("fits", lambda r: torch.full((NUMEL,), float(r + 1))),
    ("too many elements", lambda r: torch.ones(NUMEL + 1)),
    ("not contiguous", lambda r: torch.ones(2 * NUMEL)[::2]),
    ("int32", lambda r: torch.ones(NUMEL, dtype=torch.int32)),
    ("fits again", lambda r: torch.full((NUMEL,), float(10 * (r + 1)))),
)
FALLBACK = -7.0  # what the stand-in for the runtime's own all-reduce returns: it marks the branch


def communicator(compiled: bool) -> list:
    """inside-a-model.md's communicator pattern, eager or compiled (``fullgraph=True``, aot_eager):
    ``ar(x)`` where ``ar.accepts(x)``, else the runtime's own path (a stand-in that marks it)."""
    buf = ss.SymmetricBuffer(C.workspace_bytes(NUMEL, torch.float32, 2), backend="host")
    ar = C.AllReduce(buf.view([0, 1]), NUMEL, torch.float32, timeout_s=60)

    def all_reduce(x):
        if ar.accepts(x):
            return ar(x)
        return torch.full_like(x, FALLBACK)

    call = torch.compile(all_reduce, fullgraph=True, backend="aot_eager") if compiled else all_reduce
    torch._dynamo.reset()
    out = [(name, call(make(buf.rank)).tolist()) for name, make in COMMUNICATOR_INPUTS]
    buf.close()
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_communicator_pattern_takes_the_fast_path_exactly_where_it_fits(pool, compiled):
    for rank, results in enumerate(pool.call(communicator, compiled)):
        got = dict(results)
        assert list(got) == [name for name, _ in COMMUNICATOR_INPUTS]
        # the members' sum (1 + 2, 10 + 20) where it fits, the fallback's mark elsewhere
        assert got["fits"] == [3.0] * NUMEL, (rank, got["fits"])
        assert got["fits again"] == [30.0] * NUMEL, (rank, got["fits again"])
        for name in ("too many elements", "not contiguous", "int32"):
            x = dict(COMMUNICATOR_INPUTS)[name](rank)
            assert got[name] == [FALLBACK] * x.numel(), (rank, name, got[name])


# ---------------------------------------------------------------------- a model's Parameters
class DecoderLayer(torch.nn.Module):
    """docs/inside-a-model.md's fragment, whole: its tail's fused call takes the layer's norm
    weight, an ``nn.Parameter`` (a stand-in projection gives this rank's partial sum)."""

    def __init__(self, ar: C.AllReduce, hidden_size: int, eps: float):
        super().__init__()
        self.ar, self.eps = ar, eps
        self.norm_weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden_size, dtype=torch.bfloat16))

    def forward(self, hidden, residual):
        partial = hidden * 2.0  # this rank's partial sum: no reduction yet
        return self.ar(partial, residual=residual, norm_weight=self.norm_weight, eps=self.eps)


def decoder_layer(compiled: bool) -> list:
    """The layer's outputs (normed, new residual) for 3 steps, and the torch oracle's: the members'
    partial sums gathered by torch.distributed, summed in member order in float32, then the
    documented epilogue (docs/collectives.md)."""
    torch._dynamo.reset()
    world, rank = dist.get_world_size(), dist.get_rank()
    buf = ss.SymmetricBuffer(C.workspace_bytes(NUMEL, torch.bfloat16, world), backend="host")
    ar = C.AllReduce(buf.view(list(range(world))), NUMEL, torch.bfloat16, timeout_s=60)
    layer = DecoderLayer(ar, HIDDEN, 1e-6)
    call = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    out = []
    with torch.no_grad():
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            hidden = torch.randn(NUMEL // HIDDEN, HIDDEN, generator=g).to(torch.bfloat16)
            residual = torch.randn(NUMEL // HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(step))
            residual = residual.to(torch.bfloat16)
            y, new_residual = call(hidden, residual)
            partials = [None] * world
            dist.all_gather_object(partials, hidden * 2.0)
            acc = partials[0].float()
            for p in partials[1:]:
                acc = acc + p.float()
            want_r = (acc.to(torch.bfloat16).float() + residual.float()).to(torch.bfloat16)
            h = want_r.float()
            want_y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.norm_weight.float()
            out.append(
                (
                    torch.equal(new_residual.view(torch.int16), want_r.view(torch.int16)),
                    float((y.float() - want_y.to(torch.bfloat16).float()).abs().max()),
                )
            )
    buf.close()
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_decoder_layer_passes_its_norm_weight_parameter_to_the_fused_call(pool, compiled):
    for rank, steps in enumerate(pool.call(decoder_layer, compiled)):
        assert len(steps) == 3, (rank, steps)
        for step, (residual_exact, y_diff) in enumerate(steps):
            assert residual_exact, (rank, step, "the new residual differs from the oracle's bits")
            # The normed output's mean is a tree sum in the kernel, a torch reduction in the oracle.
            assert y_diff <= 1.6e-2 * 8, (rank, step, y_diff)


#: Bad fused calls, each with one property of one tensor wrong, and the words its refusal must hold.
DIFFERS = {
    "norm_weight of another dtype": (
        {"norm_weight": torch.ones(HIDDEN, dtype=torch.float64)},
        "norm_weight must be torch.float32, got torch.float64",
    ),
    "norm_weight of another shape": (
        {"norm_weight": torch.ones(HIDDEN + 1)},
        f"norm_weight must have shape ({HIDDEN},) (x.shape[-1:]), got ({HIDDEN + 1},)",
    ),
    "norm_weight not contiguous": ({"norm_weight": torch.ones(2 * HIDDEN)[::2]}, "norm_weight must be contiguous"),
    "norm_weight on meta": ({"norm_weight": torch.ones(HIDDEN, device="meta")}, "norm_weight is on meta"),
    "residual of another shape": (
        {"residual": torch.zeros(HIDDEN)},
        f"residual must have shape ({NUMEL // HIDDEN}, {HIDDEN}) (x's), got ({HIDDEN},)",
    ),
    "norm_weight requires grad": (
        {"norm_weight": torch.nn.Parameter(torch.ones(HIDDEN))},
        "norm_weight requires grad and grad mode is on",
    ),
}


def refusals(names) -> dict:
    out = {}
    for name in names:
        kwargs = {"residual": torch.zeros(NUMEL // HIDDEN, HIDDEN), "norm_weight": torch.ones(HIDDEN)}
        kwargs.update(DIFFERS[name][0])
        buf = ss.SymmetricBuffer(C.workspace_bytes(NUMEL, torch.float32, 2), backend="host")
        ar = C.AllReduce(buf.view([0, 1]), NUMEL, torch.float32, timeout_s=60)
        try:
            ar(torch.ones(NUMEL // HIDDEN, HIDDEN), **kwargs)
            out[name] = "returned"
        except ss.InputError as e:
            out[name] = str(e)
        buf.close()
    return out


def test_a_refused_tensor_is_told_what_differs(pool):
    for rank, said in enumerate(pool.call(refusals, list(DIFFERS))):
        for name, (_, words) in DIFFERS.items():
            assert f"rank {rank}: AllReduce: {words}" in said[name], (rank, name, said[name])
