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

``handle`` names the collective (its ``op_handle`` attribute, :mod:`symmsync.ops.handles`); the
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

Each op's body is the eager call's own checked path (:meth:`AllReduce.eager` and its
siblings: the checks run once, then the launch), entered through one pass of the dispatcher
(:mod:`symmsync.ops.oplib`). It keeps none of its tensors: a bound launch holds what its last
call packed to, never the tensors (:class:`~symmsync.core.launch.BoundLaunch`), so under
``torch.compile(mode="reduce-overhead")``, where the op runs while torch records a CUDA
graph into its own memory pool, nothing outside the graph holds that pool's memory.
Replays of a captured graph run no Python at all.
"""

import torch

from ..ops import handles, oplib
from .operations import AllGather, AllReduce, ReduceScatter


def _all_reduce(x, handle, algorithm):
    return handles.lookup(handle, AllReduce).eager(x, None, algorithm)


def _fused(x, residual, weight, eps, handle, algorithm):
    return handles.lookup(handle, AllReduce).eager_fused(x, None, algorithm, residual, weight, eps, None)


def _all_gather(x, handle, size):
    return handles.lookup(handle, AllGather).eager(x, None)


def _reduce_scatter(x, handle, size):
    return handles.lookup(handle, ReduceScatter).eager(x, None)


oplib.define(
    "all_reduce", "(Tensor x, int handle, str algorithm) -> Tensor", _all_reduce, lambda x, h, a: torch.empty_like(x)
)
oplib.define(
    "all_reduce_residual_rms_norm",
    "(Tensor x, Tensor residual, Tensor weight, float eps, int handle, str algorithm) -> (Tensor, Tensor)",
    _fused,
    lambda x, r, w, e, h, a: (torch.empty_like(x), torch.empty_like(x)),
)
oplib.define(
    "all_gather", "(Tensor x, int handle, int size) -> Tensor", _all_gather, lambda x, h, n: x.new_empty(n * x.numel())
)
oplib.define(
    "reduce_scatter",
    "(Tensor x, int handle, int size) -> Tensor",
    _reduce_scatter,
    lambda x, h, n: x.new_empty(x.numel() // n),
)
