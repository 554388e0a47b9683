"""Collectives over a peer view: all-reduce, all-gather and reduce-scatter.

Built only on symmsync's public API (like :mod:`symmsync.pcp`): a buffer's peer view,
a :class:`~symmsync.Fence` channel (its device-resident epoch and kernel arguments),
the device primitives of :mod:`symmsync.language`, the launcher of
:mod:`symmsync.core.launch` and the agreement of :mod:`symmsync.core.agreement`::

    from symmsync import collectives

    buf = ss.SymmetricBuffer(collectives.workspace_bytes(n, torch.bfloat16, world))
    ar = collectives.AllReduce(buf.view(list(range(world))), n, torch.bfloat16)
    y = ar(x)                        # the sum over the members, the same bits on every member

Calls are one kernel launch each, need no host barrier between them, can be captured
in a CUDA graph, and refuse (on every member) calls that differ between members. Over a
view whose members span nodes, the same objects run node steps and one exchange between
nodes through torch.distributed (:mod:`.spanning`; not in a CUDA graph).
"""

from . import spanning as _spanning  # noqa: F401 - registers the forms over nodes (collectives.operations.FORMS)
from . import torch_ops as _torch_ops  # noqa: F401 - registers the symmsync:: ops of the collectives
from .inputs import MAX_HIDDEN
from .layout import ALGORITHMS, Workspace, workspace_bytes
from .mismatch import CollectiveMismatch
from .operations import AllGather, AllReduce, ReduceScatter
from .tuning import choose

__all__ = [
    "ALGORITHMS",
    "AllGather",
    "AllReduce",
    "CollectiveMismatch",
    "MAX_HIDDEN",
    "ReduceScatter",
    "Workspace",
    "choose",
    "workspace_bytes",
]
