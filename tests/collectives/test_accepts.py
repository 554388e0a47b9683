"""Asking before calling: ``accepts()`` is False exactly when the call raises an input error.

Host backend, world 2. For each case of a sweep (both ranks pass the same arguments, so that a
good call completes and a bad one fails on each rank by itself), a fresh buffer and object:
the predicate's answer, then the call's outcome. The oracle is the call itself: ``accepts()``
must be False exactly where the call raised ``InputError``, True where it returned (the
writer's: tests/pcp/test_pcp_accepts.py). Then docs/inside-a-model.md's communicator pattern
(``ar(x)`` where ``ar.accepts(x)``, the runtime's own path elsewhere), eager and compiled
with ``fullgraph=True``: the members' sum where the input fits, the fallback's mark where it
does not, and the fast path still working after them.
"""

import pytest
import torch

import symmsync as ss
from symmsync import collectives as C
from symmsync.testing import RankPool

NUMEL, HIDDEN = 64, 16


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout_s=240) as p:
        yield p


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
]


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
        # the sweep holds both answers
        assert {said for _, said, _ in results} == {True, False}, results


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
