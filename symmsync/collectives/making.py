"""How a collective is made: its arguments' checks and the one agreement among the ranks.

Both forms of an operation share them: the one-kernel form over a view within one node
(:mod:`.ops`) and the form over a view that spans nodes (:mod:`.spanning`). Construction is
collective over the buffer's group: every rank checks its own arguments into a problem, one
exchange (:func:`symmsync.core.agreement.agree`) carries every rank's problem and values, and every
rank raises the same error or none does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import int_problem
from ..core import agreement
from ..core.regions import Region
from ..core.views import PeerView
from ..errors import BoundsError, ClosedError, ConfigError
from . import layout as L
from .mismatch import gpu_identity

_NODE_STEPS_HINT = (
    "collectives made together over views that span nodes must be one operation on every rank of the buffer's "
    "group, and every rank's view must span nodes then: each rank makes a node view and node steps, collectively "
    "over the group (docs/collectives.md, 'Across nodes')"
)


def arguments_problem(call: str, view: Any, max_numel: Any, dtype: Any, algorithm: Any, offset: Any) -> tuple:
    """``(buffer, problem, error)``: what is wrong with this rank's arguments to ``call``
    (``problem`` ``None``: nothing), to be agreed. Raises at once where no exchange can be
    made: ``view`` is no :class:`~symmsync.PeerView`, or its buffer is closed."""
    if not isinstance(view, PeerView):
        raise ConfigError(f"{call}: view must be a symmsync.PeerView, got {type(view).__name__}")
    buf = view.buffer
    if buf.closed:
        raise ClosedError(f"rank {buf.rank}: {call}: the view's buffer is closed")
    problem, error = None, ConfigError
    if dtype not in L.DTYPES:
        problem = f"dtype must be one of {', '.join(map(str, L.DTYPES))}, got {dtype!r}"
    else:
        problem = int_problem("max_numel", max_numel, minimum=1) or int_problem("offset", offset, minimum=0)
    if problem is None and offset % L.LINE:
        problem, error = f"offset must be a multiple of {L.LINE} bytes, got {offset}", BoundsError
    if problem is None and algorithm is not None and algorithm not in L.ALGORITHMS:
        problem = f"algorithm must be one of {L.ALGORITHMS}, got {algorithm!r}"
    return buf, problem, error


def fit_problem(buf: Any, offset: int, nbytes: int, nodes: int = 1) -> tuple[str | None, type]:
    """``(problem, error)``: whether ``nbytes`` of workspace at ``offset`` fit in ``buf``
    (``nodes``: the nodes the view spans, as :func:`~symmsync.collectives.workspace_bytes` takes them)."""
    if offset + nbytes <= buf.nbytes:
        return None, ConfigError
    sized = "" if nodes == 1 else f", nodes={nodes}"
    return (
        f"the workspace needs bytes [{offset}, {offset + nbytes}) of the buffer, which holds {buf.nbytes}: "
        f"allocate symmsync.collectives.workspace_bytes(...{sized}) more, or lower max_numel"
    ), BoundsError


def workspace_region(call: str, view: PeerView, channel: int, ws: L.Workspace) -> Region:
    """The bytes a collective's workspace claims (:mod:`symmsync.core.regions`). Its share key is the
    workspace's layout and the view's fence cell of its channel: collectives with both equal make calls
    ordered by that channel's epochs over slots at the same places, as one collective's calls are."""
    owner = f"{call} (view {list(view.ranks)}, channel {channel})"
    return Region(
        owner, ws.offset, ws.offset + ws.nbytes, share=("collective workspace", view.cell_offset(channel), ws)
    )


def agree(
    call: str,
    view: PeerView,
    arguments: dict[str, Any],
    problem: str | None,
    error: Any,
    steps: str = "",
) -> tuple[int, ...]:
    """The construction's one exchange over the buffer's group (collective).

    Every rank raises the first rank's problem, or a difference in ``arguments`` among a
    view's members, or a difference in ``steps`` among all ranks, or none does.

    Args:
        call: the operation (``"AllReduce"``).
        view: this rank's view.
        arguments: the values a view's members must pass alike, by name.
        problem: what is wrong with this rank's arguments, or ``None``.
        error: the class ``problem`` raises.
        steps: the operation whose node steps this rank makes over a view that spans nodes
            (``""``: none). Alike on every rank of the group: the node view and each node step
            are made collectively over the group, so every rank must make the same ones.

    Returns:
        The other members of ``view`` on this rank's GPU (several processes on one device).
    """
    buf = view.buffer
    members = tuple(view.ranks)
    alike = agreement.Same(among=members, hint=f"every member of the view {list(members)} must pass the same")
    mine = dict(arguments)
    same = dict.fromkeys(mine, alike)
    mine["the node steps"] = steps or "none (one node)"
    same["the node steps"] = agreement.Same(hint=_NODE_STEPS_HINT)
    mine["the GPU"] = gpu_identity(buf.device) if buf.capabilities.streams else None  # exchanged, not compared
    agreed = agreement.agree(buf.group, call, mine, problem=problem, error=error, same=same, device=buf.device)
    gpu = mine["the GPU"]
    return tuple(r for r in members if r != buf.rank and gpu and agreed[r]["the GPU"] == gpu)


def set_protocol_words(buf: Any, ws: L.Workspace) -> None:
    """Set what a collective's protocol reads before its first write, on this member, then end the
    construction with a barrier over the buffer's group (collective; after :func:`agree`).

    The workspace's bytes may hold what another owner left there (a dropped collective's inputs,
    a user's region): the arrival counter, which a launch's programs count up from 0 (the one
    whose count reaches the target publishes), and the headers are zeroed here. After the
    agreement, so that every member has finished the calls it made on these bytes before (a
    slow member still reading a dropped collective's slot in this member's memory); before the
    barrier, so that no member's first call runs before every member set its words. (A member
    writes only its own workspace: the others read it after its publish.) On GPUs a member's
    earlier kernels may still run when it enters the agreement: an earlier owner given back with
    ``close()`` waited for the device first; one only dropped did not.
    """
    buf.tensor(ws.headers, (L.INPUT - L.HEADERS,), torch.uint8).zero_()
    agreement.barrier(buf.group)


def arguments(max_numel: int, dtype: torch.dtype, algorithm: str | None, offset: int, channel: int) -> dict:
    """The arguments a view's members must pass alike, by the names the messages give them."""
    return {
        "max_numel": max_numel,
        "the dtype": str(dtype),
        "the algorithm": algorithm,
        "the offset": offset,
        "the channel": channel,
    }
