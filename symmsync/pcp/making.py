"""How the direct-KV writer is made: its arguments' checks and the one agreement among the ranks.

Construction is collective over the buffer's group, with the consumer kit
(:class:`symmsync.core.making.Making`): every rank checks its own arguments into a problem, one
exchange carries every rank's problem and values, and every rank raises the same error or none
does. The members of a PCP group must agree on the layout (formats included) and the channel;
every rank of the group on the route, and on whether its view spans nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core import agreement
from ..core.making import Making
from ..errors import ConfigError
from ..spanning import parts as spanning
from .layout import CacheLayout, CacheTensors
from .routes import Route, route_for
from .tuning import Tuning

_NODE_VIEW_HINT = (
    "a view's first consumer over nodes makes its node view, collectively over the buffer's group: every rank must "
    "make its views' first consumers over nodes together"
)
_ROUTE_HINT = "every rank must take the same route, and the views of every rank span nodes or none does"


@dataclass
class Agreed:
    """A writer's construction, agreed on every rank (what :func:`make` returns).

    Attributes:
        make: the agreed construction (its claims made by ``Consumer.made``).
        route: the route as the view's node layout makes it.
        fused: whether the direct route's kernel fences in its tail.
        placement: where the layout's layers lie in the buffer.
        tuning: how the kernel is launched.
        fence: the fence of the writer's channel on its view (``None`` across nodes: made on the node view).
    """

    make: Making
    route: Route
    fused: bool
    placement: Any
    tuning: Tuning
    fence: Any


def make(
    view: Any,
    layout: Any,
    route: str,
    fused: Any,
    group: Any,
    channel: Any,
    timeout_s: Any,
    tuning: Any,
    **shorthand: Any,
) -> Agreed:
    """This rank's checks of a writer's arguments (``shorthand``: the :class:`Tuning` fields passed
    alone), then the construction's one exchange (collective over the buffer's group)."""
    make = Making("DirectKVWriter", view)
    buf = make.buffer
    fused = route == "direct" if fused is None else bool(fused)
    placement = None
    how, route_problem = route_for(view, route)  # the route as the view's node layout makes it
    if not isinstance(layout, (CacheLayout, CacheTensors)):
        make.check(f"layout must be a symmsync.pcp.CacheLayout or CacheTensors, got {type(layout).__name__}")
    elif make.check(route_problem) and fused and route != "direct":
        make.check("fused=True needs route='direct' (the all-gather route has no fence to fuse)")
    if make.ok:
        try:
            placement = layout.placement(buf)
        except ConfigError as e:
            make.check(str(e), type(e))
    if make.ok and how.among == "group" and group is None and view.size != buf.world_size:
        make.check("the allgather route needs group=, the torch.distributed group of the view's ranks")
    if make.ok:
        tuning, problem = Tuning.with_shorthand(tuning, **shorthand)
        make.check(problem)
    if make.ok and how.spans and spanning.channels_left(view) < 1:
        make.check(
            "the view's node view has no fence channel left for the writer (the consumers over this view took "
            "them all): pass channels= to SymmetricBuffer for more"
        )
    fence = make.fence(channel, timeout_s) if make.ok and not how.spans else None  # a bad one: agreed
    members = tuple(view.ranks)
    if make.ok:  # the caches' bytes, shared only by writers of these caches on this PCP group
        owner, share = f"DirectKVWriter (view {list(members)}) caches", ("kv caches", members, placement.agreed())
        for start, stop in placement.spans():
            make.claim(owner, start, stop, share=share)
    make.agree(
        {"the layout": placement.agreed() if placement is not None else None, "the channel": channel},
        hint=f"every member of the PCP group {list(members)} must pass the same",
        group_wide={
            "the route": (how.agreed(fused) if how is not None else route, agreement.Same(hint=_ROUTE_HINT)),
            "the node view": (
                "made here" if how is not None and how.spans and not spanning.made(view) else None,
                agreement.Same(hint=_NODE_VIEW_HINT),
            ),
        },
    )
    return Agreed(make, how, fused, placement, tuning, fence)
