"""The fence as a torch custom op, for code compiled with ``torch.compile``.

``Fence.fence()``, ``arrive()`` and ``wait()`` call ``torch.ops.symmsync.fence(handle, kind)``
while Dynamo traces (``torch.compiler.is_compiling()``), so a model compiled with
``fullgraph=True`` keeps its fences in the graph instead of breaking it; eager calls never
reach the op (they launch directly, as before).

The op returns nothing and mutates nothing. It is registered as an *ordered effect*
(torch threads an effect token through every such op), so no compiler drops it or moves
it past another effectful op: the fence stays ordered with the writes that symmsync's own
ops make (the direct-KV writer's op declares the caches it writes, and runs in place).
It does not order plain torch writes into symmetric memory: functionalization applies a
graph's writes into its inputs at the end of the graph, after the fence, so peers would
read stale bytes (tests/core/test_torch_compile.py measures it). Such writes belong in
eager code, in a piece of a split graph that runs before the fence, or in a custom op of
their own that declares the tensor it mutates. The op takes the members' user regions
(``orders``) so that Dynamo's trace sees such writes: a fence that follows writes into
them in the same graph raises :class:`~symmsync.ConfigError` at trace time, whatever the
backend (Dynamo cannot know whether the backend splits the graph at the fence). Writes
through tensors that are not views of the buffer's (registered memory reached another
way) are not seen.
"""

from __future__ import annotations

import weakref

import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

from . import handles
from .errors import ConfigError

FENCE, ARRIVE, WAIT = 0, 1, 2  # the kinds, in the order of Fence's launches


@torch.library.custom_op("symmsync::fence", mutates_args=())
def fence_op(handle: int, kind: int, orders: list[torch.Tensor]) -> None:
    """Run the fence ``handle`` names (``kind`` 0 fence, 1 arrive, 2 wait). ``orders``: the
    user regions of the view's members, as this rank maps them (read by the trace-time check)."""
    from .fence import Fence  # fence.py imports this module

    handles.lookup(handle, Fence)._launch_now(kind)


@fence_op.register_fake
def _(handle: int, kind: int, orders: list[torch.Tensor]) -> None:
    from .fence import Fence

    real = handles.lookup(handle, Fence)._orders()
    written = [
        i
        for i, (t, r) in enumerate(zip(orders, real))
        if _version(t) not in (0, r._version, _op_versions.get(_root(t)))
    ]
    if written:
        raise ConfigError(UNORDERED.format(members=written))


# Dynamo runs the fakes while it traces, on fake tensors whose version starts at zero or at
# the real tensor's (views), and every write into a tensor or a view of it bumps it: a
# version that neither that start nor a symmsync op's own write (which runs in place, or
# refuses to run) explains means the graph wrote into symmetric memory with plain torch, a
# write functionalization would apply at the end of the graph. A best-effort check: a plain
# write that happens to land on one of those versions is not seen.
_op_versions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fake base -> version after an op


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _version(t: torch.Tensor) -> int:
    return _root(t)._version


def note_op_write(t: torch.Tensor) -> None:
    """Record, in a mutating symmsync op's fake, the write it makes into ``t``."""
    _op_versions[_root(t)] = _version(t) + 1


#: The refusal of a graph that writes into symmetric memory before a fence.
UNORDERED = (
    "a compiled fence follows writes into symmetric memory (of view members {members}) in the same graph: "
    "functionalization applies a graph's writes into its inputs at the end of the graph, after the fence, so "
    "peers would read stale bytes. Make those writes before the compiled code (or in a graph that ends "
    "before the fence), or write through a symmsync op that declares what it mutates (DirectKVWriter.write)"
)

_register_effectful_op(torch.ops.symmsync.fence.default, _EffectType.ORDERED)
