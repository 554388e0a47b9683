"""The collectives as torch custom ops: what a graph that ``torch.compile`` traced calls.

Inside a function being compiled (``torch.compiler.is_compiling()``), ``ar(x)``,
``ar(x, residual=r, norm_weight=w, eps=e)``, ``ag(x)`` and ``rs(x)`` trace to these ops
instead of launching, so the same model code compiles with ``fullgraph=True`` (a Python
object, or the eager path's comparison of data pointers, cannot enter a graph)::

    symmsync::all_reduce(Tensor x, int handle, str algorithm) -> Tensor
    symmsync::all_reduce_residual_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps,
                                           int handle, str algorithm) -> (Tensor, Tensor)
    symmsync::all_gather(Tensor x, int handle, int size) -> Tensor
    symmsync::reduce_scatter(Tensor x, int handle, int size) -> Tensor

``handle`` names the collective (its ``handle`` attribute, :mod:`symmsync.handles`); the
fused op returns ``(out, residual_out)``, as the eager call does; ``size`` is the view's
size, which the output's shape depends on. Each op runs the eager call
of the object its handle names: a call in a compiled graph checks its input, launches and
fails exactly as an eager one does (docs/collectives.md, "When a call fails"), and returns
new tensors, never an input: functionalization has no write to defer, whatever the backend.
The fake implementations give the outputs' shapes from their arguments alone (symbolic
sizes included: a dynamic token count compiles once), never from the object a handle
names: Inductor's graph cache keys a graph by its nodes and constants, and a fake that read
the view's size from the object made a graph compiled for 2 members serve 3 (an
all-gather of the wrong size) once the cache held it.

The ops are marked side-effecting (``torch.fx.node.has_side_effect``): a graph that drops
a collective's result still makes the call, since its members wait for it; a pure op whose
output went unused would be removed by dead-code elimination (Dynamo's, AOTAutograd's and
Inductor's) on that rank alone.

An op's call keeps none of its tensors: it drops the collective's bound launches
(:class:`~symmsync.launch.BoundLaunch` holds the last call's tensors, so that an eager call
with the same tensors repacks nothing) once it launched. Under
``torch.compile(mode="reduce-overhead")`` the op runs while torch records a CUDA graph into
its own memory pool, and torch refuses a recording whose pool memory something outside the
graph still holds ("tensor(s) in the cudagraph pool not tracked as outputs"). A compiled call
repacks its arguments each time; replays of a captured graph run no Python at all.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import handles
from .ops import AllGather, AllReduce, ReduceScatter

T = TypeVar("T")


def _call(handle: int, kind: type[T], call: Callable[[T], Any]) -> Any:
    """``call`` on the object ``handle`` names; then drop what its bound launches hold."""
    obj = handles.lookup(handle, kind)
    try:
        return call(obj)
    finally:
        obj._bound.clear()  # the last call's tensors (see the module's docstring)


@torch.library.custom_op(
    "symmsync::all_reduce", mutates_args=(), schema="(Tensor x, int handle, str algorithm) -> Tensor"
)
def all_reduce(x, handle, algorithm):
    return _call(handle, AllReduce, lambda ar: ar(x, algorithm=algorithm))


@all_reduce.register_fake
def _(x, handle, algorithm):
    return torch.empty_like(x)


@torch.library.custom_op(
    "symmsync::all_reduce_residual_rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor weight, float eps, int handle, str algorithm) -> (Tensor, Tensor)",
)
def all_reduce_residual_rms_norm(x, residual, weight, eps, handle, algorithm):
    return _call(
        handle, AllReduce, lambda ar: ar(x, algorithm=algorithm, residual=residual, norm_weight=weight, eps=eps)
    )


@all_reduce_residual_rms_norm.register_fake
def _(x, residual, weight, eps, handle, algorithm):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("symmsync::all_gather", mutates_args=(), schema="(Tensor x, int handle, int size) -> Tensor")
def all_gather(x, handle, size):
    return _call(handle, AllGather, lambda ag: ag(x))


@all_gather.register_fake
def _(x, handle, size):
    return x.new_empty(size * x.numel())


@torch.library.custom_op(
    "symmsync::reduce_scatter", mutates_args=(), schema="(Tensor x, int handle, int size) -> Tensor"
)
def reduce_scatter(x, handle, size):
    return _call(handle, ReduceScatter, lambda rs: rs(x))


@reduce_scatter.register_fake
def _(x, handle, size):
    return x.new_empty(x.numel() // size)


for _name in ("all_reduce", "all_reduce_residual_rms_norm", "all_gather", "reduce_scatter"):
    torch.fx.node.has_side_effect(getattr(torch.ops.symmsync, _name).default)
