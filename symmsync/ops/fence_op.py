"""The fence as a torch custom op, for code compiled with ``torch.compile``.

``Fence.fence()``, ``arrive()`` and ``wait()`` call ``symmsync::fence(int handle, int kind,
Tensor[] orders) -> ()``
while Dynamo traces (``torch.compiler.is_compiling()``), so a model compiled with
``fullgraph=True`` keeps its fences in the graph instead of breaking it; eager calls never
reach the op (they launch directly, as before).

The op returns nothing and mutates nothing. It is registered as side-effectful
(``torch.fx.node.has_side_effect``), so no compiler drops it; it stays where it was traced
among symmsync's other ops, which are side-effectful too (the direct-KV writer's op
declares the caches it writes, and runs in place).
It does not order plain torch writes into symmetric memory: functionalization applies a
graph's writes into its inputs at the end of the graph, after the fence, so peers would
read stale bytes (tests/compile/test_compiled_fence.py measures it). Such writes belong in
eager code before the compiled code, or in a custom op that declares the tensor it
mutates. The op takes the members' user regions (``orders``) so that its fake, which
Dynamo runs while it traces, finds such writes in the graph traced so far: a fence that
follows them raises :class:`~symmsync.ConfigError` at trace time, whatever the backend
(Dynamo cannot know whether the backend will split the graph at the fence). Writes
through tensors over other storage (registered memory reached another way) are not seen.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch

from ..errors import ConfigError
from . import handles, oplib

FENCE, ARRIVE, WAIT = 0, 1, 2  # the op's kinds; a Fence indexes its launches by them (core/fence.py)


_served: list[type] = []  # the class whose objects the op runs: symmsync.core.fence.Fence, by serve()


def serve(cls: type) -> None:
    """Name the class whose objects ``symmsync::fence`` runs (:class:`symmsync.core.fence.Fence` calls
    this as it is defined: a registration, since this layer is below the fence's)."""
    _served[:] = [cls]


def _fence(handle: int, kind: int, orders: list[torch.Tensor]) -> None:
    """Run the fence ``handle`` names (``kind`` 0 fence, 1 arrive, 2 wait): its ``launch_now``.
    ``orders``: the user regions of the view's members, as this rank maps them (read by the
    trace-time check)."""
    handles.lookup(handle, _served[0]).launch_now(kind)


def _fence_fake(handle: int, kind: int, orders: list[torch.Tensor]) -> None:
    written = plain_writes(orders)
    if written:
        raise ConfigError(UNORDERED.format(members=written))


def plain_writes(tensors: list[torch.Tensor]) -> list[int]:
    """Which of ``tensors`` (fakes) the graph Dynamo is tracing wrote into before this point
    with plain torch: an in-place method or op, or an item assignment, on a tensor that
    shares its storage. Writes by symmsync's own ops (which run in place, or refuse to run)
    are in order and do not count. Outside Dynamo's trace (the later passes): none."""
    from torch.multiprocessing.reductions import StorageWeakRef

    tx = oplib.tracer()
    if tx is None:
        return []
    index = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(tensors)}
    written = set()
    for node in tx.output.graph.nodes:
        target = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        value = target.meta.get("example_value") if target is not None else None
        if isinstance(value, torch.Tensor) and _writes(node):
            i = index.get(StorageWeakRef(value.untyped_storage()))
            if i is not None:
                written.add(i)
    return sorted(written)


def _writes(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into its first argument (and is not a symmsync op)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function" or str(node.target).startswith("symmsync."):
        return False
    if node.target is operator.setitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


_user_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # buffer -> its ranks' user regions


def user_views(buf: Any) -> list[torch.Tensor]:
    """Every rank's user region of ``buf`` as ``uint8`` tensors, the same objects for every
    caller while the size stays: aot_autograd takes mutated views of one memory as graph
    inputs only when they share one ``_base``, so the fence's ``orders`` and the tensors
    symmsync's ops mutate (the writer's caches) are views of these. ``None`` for a rank of
    another node, which this rank does not map (symmsync.core.nodes)."""
    views = _user_views.get(buf)
    if views is None or views[buf.rank].numel() != buf.nbytes:
        near = buf.nodes.members_of(buf.rank)
        views = [
            buf.tensor(0, (buf.nbytes,), torch.uint8, rank=r) if r in near else None for r in range(buf.world_size)
        ]
        _user_views[buf] = views
    return views


#: The refusal of a graph that writes into symmetric memory before a fence.
UNORDERED = (
    "a compiled fence follows writes into symmetric memory (of view members {members}) in the same graph: "
    "functionalization applies a graph's writes into its inputs at the end of the graph, after the fence, so "
    "peers would read stale bytes. Make those writes before the compiled code (or in a graph that ends "
    "before the fence), or write through a symmsync op that declares what it mutates (DirectKVWriter.write)"
)

# Side-effecting (symmsync.ops.oplib), so never dropped as dead code (it returns nothing). Not an
# ordered effect: torch 2.13's effect tokens broke graphs that also mutate aliased inputs (the
# writer's caches): aot_eager failed at run time, Inductor asked for a backward token.
fence_op = oplib.define("fence", "(SymInt handle, SymInt kind, Tensor[] orders) -> ()", _fence, _fence_fake)
