"""How a collective is made: its arguments' checks and the one agreement among the ranks.

Both forms of an operation share them: the one-kernel form over a view within one node
(:mod:`.operations`) and the form over a view that spans nodes (:mod:`.spanning`). Construction is
collective over the buffer's group, with the consumer kit (:class:`symmsync.core.consumer.Making`):
every rank checks its own arguments into a problem, one exchange carries every rank's problem
and values, and every rank raises the same error or none does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import agreement
from ..core.making import Making
from ..language.cells import LINE
from . import layout as L

_NODE_STEPS_HINT = (
    "collectives made together over views that span nodes must be one operation on every rank of the buffer's "
    "group, and every rank's view must span nodes then: each rank makes a node view and node steps, collectively "
    "over the group (docs/collectives.md, 'Across nodes')"
)


def start(call: str, view: Any, max_numel: Any, dtype: Any, algorithm: Any, offset: Any) -> Making:
    """This rank's construction of ``call`` (:class:`~symmsync.core.consumer.Making`), its arguments
    checked. Raises at once where no exchange can be made: ``view`` is no
    :class:`~symmsync.PeerView`, or its buffer is closed."""
    make = Making(call, view)
    if dtype not in L.DTYPES:
        make.check(f"dtype must be one of {', '.join(map(str, L.DTYPES))}, got {dtype!r}")
    if make.ints(max_numel=(max_numel, 1, None)) and make.offset(offset):
        if algorithm is not None and algorithm not in L.ALGORITHMS:
            make.check(f"algorithm must be one of {L.ALGORITHMS}, got {algorithm!r}")
    return make


def fits(make: Making, offset: int, nbytes: int, nodes: int = 1) -> bool:
    """Check that ``nbytes`` of workspace at ``offset`` fit in the buffer (``nodes``: the nodes the
    view spans, as :func:`~symmsync.collectives.workspace_bytes` takes them)."""
    sized = "" if nodes == 1 else f", nodes={nodes}"
    return make.fits(
        offset, nbytes, f"allocate symmsync.collectives.workspace_bytes(...{sized}) more, or lower max_numel"
    )


def claim_workspace(make: Making, channel: int, ws: L.Workspace | None) -> None:
    """The bytes a collective's workspace claims (:mod:`symmsync.core.regions`). Its share key is the
    workspace's layout and the view's fence cell of its channel: collectives with both equal make calls
    ordered by that channel's epochs over slots at the same places, as one collective's calls are."""
    if ws is not None:
        view = make.view
        owner = f"{make.call} (view {list(view.ranks)}, channel {channel})"
        make.claim(
            owner, ws.offset, ws.offset + ws.nbytes, share=("collective workspace", view.cell_offset(channel), ws)
        )


def agree(make: Making, arguments: dict[str, Any], steps: str = "") -> None:
    """The construction's one exchange over the buffer's group (collective).

    Every rank raises the first rank's problem, or a difference in ``arguments`` among a
    view's members, or a difference in ``steps`` among all ranks, or none does.

    Args:
        make: this rank's construction (its ``shares_gpu`` is set by the exchange).
        arguments: the values a view's members must pass alike, by name.
        steps: the operation whose node steps this rank makes over a view that spans nodes
            (``""``: none). Alike on every rank of the group: the node view and each node step
            are made collectively over the group, so every rank must make the same ones.
    """
    make.agree(
        arguments,
        group_wide={"the node steps": (steps or "none (one node)", agreement.Same(hint=_NODE_STEPS_HINT))},
    )


def set_protocol_words(buf: Any, ws: L.Workspace) -> None:
    """Set what a collective's protocol reads before its first write, on this member, then end the
    construction with a barrier over the buffer's group (collective; after :func:`agree`).

    The workspace's bytes may hold what another owner left there (a dropped collective's inputs,
    a user's region): the arrival counter, which a launch's programs count up from 0 (the one
    whose count reaches the target publishes), is zeroed here. After the
    agreement, so that every member has finished the calls it made on these bytes before (a
    slow member still reading a dropped collective's slot in this member's memory); before the
    barrier, so that no member's first call runs before every member set its words. (A member
    writes only its own workspace: the others read it after its publish.) On GPUs a member's
    earlier kernels may still run when it enters the agreement: an earlier owner given back with
    ``close()`` waited for the device first; one only dropped did not.
    """
    buf.tensor(ws.counter, (LINE,), torch.uint8).zero_()
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
