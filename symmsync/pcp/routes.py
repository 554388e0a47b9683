"""The writer's routes by node layout, and the one place its all-gathers run.

A *node* is a set of ranks that map each other's memory (:mod:`symmsync.core.nodes`). The
writer's route is what the caller passes (``"direct"`` or ``"allgather"``, the same on
every rank) read against the node layout of its view, which every member sees alike:

======================  =================================================================
view, ``route=``        what a rank does per layer
======================  =================================================================
one node, ``direct``    stores its rows into every replica (the view's pointer table), fence
one node, ``allgather`` all-gathers the compact KV over ``group=`` (torch.distributed), inserts
                        every row into its own replica
nodes, ``direct``       all-gathers the compact KV among the members at its node position (one
                        per node: :meth:`symmsync.spanning.exchange.OffNode.all_gather`,
                        ``among="position"``), then stores its own rows and those into every
                        replica of its node, and fences the node
nodes, ``allgather``    all-gathers the compact KV among every member (``OffNode``, ``among="view"``),
                        inserts every row into its own replica
======================  =================================================================

So across nodes ``"direct"`` means "direct where the peers map, all-gather where they do
not": the bytes of each row cross the network once per other node (to the member at the
same position there), never once per replica, and within a node they travel as final
cache bytes over the peer mappings. It needs nodes of one size (the positions pair up);
on nodes of different sizes it is refused and ``"allgather"`` is the route.

Every all-gather of the compact KV moves bytes (``uint8``): gloo has no int16 all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..spanning.exchange import OffNode
from .kernels import IDX, NOPE, ROPE, TOKEN_BYTES

if TYPE_CHECKING:
    from ..core.views import PeerView

ROUTES = ("direct", "allgather")
COMPACT_BYTES = (NOPE + ROPE + IDX) * 2  # one row of compact KV: bf16 kv_c, k_pe and indexer K

# torch 2.13 renamed all_gather_into_tensor; 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Route:
    """A writer's route as its view's node layout makes it (see the module's docstring).

    Attributes:
        name: ``"direct"`` or ``"allgather"``, as the caller passed it.
        nodes: how many nodes the view spans (1: the routes of one node, unchanged).
        near: how many members of the view are on this rank's node (itself included).
        among: whose compact KV a rank gathers per layer: ``None`` (direct on one node: none),
            ``"group"`` (every member, over the caller's torch.distributed group), and across
            nodes ``"position"`` (the member at this rank's node position on every node) or
            ``"view"`` (every member), both through :class:`~symmsync.spanning.exchange.OffNode`.
    """

    name: str
    nodes: int
    near: int
    among: str | None

    @property
    def spans(self) -> bool:
        """Whether the view spans nodes (and the writer works through a node view and ``OffNode``)."""
        return self.nodes > 1

    def bytes_per_layer(self, rows: int, members: int) -> dict[str, int]:
        """Per rank and layer, for ``rows`` rows on each of ``members`` members: the cache bytes it
        writes (into any replica), the bytes it sends to other members (cache bytes stored into
        peers, or compact KV sent by all-gather), and the part of those that crosses nodes."""
        written = rows * TOKEN_BYTES * members
        compact = rows * COMPACT_BYTES
        if self.among is None:  # direct, one node
            return {
                "cache_bytes_written": written,
                "sent_to_peers": rows * TOKEN_BYTES * (members - 1),
                "sent_off_node": 0,
            }
        if self.among == "position":  # its rows and its position peers' into the node's other replicas
            near = rows * self.nodes * TOKEN_BYTES * (self.near - 1)
            far = compact * (self.nodes - 1)
            return {"cache_bytes_written": written, "sent_to_peers": near + far, "sent_off_node": far}
        far = compact * (members - self.near)
        return {"cache_bytes_written": written, "sent_to_peers": compact * (members - 1), "sent_off_node": far}

    def agreed(self, fused: bool) -> str:
        """What every rank must take alike, in words (an agreement field)."""
        name = f"{self.name} fused" if fused else self.name
        return f"{name} across {self.nodes} nodes" if self.spans else name


def route_for(view: PeerView, route: str) -> tuple[Route | None, str | None]:
    """The :class:`Route` of ``route`` on ``view``, or ``(None, the problem)``."""
    if not isinstance(route, str) or route not in ROUTES:
        return None, f"route must be one of {ROUTES}, got {route!r}"
    nodes = view.nodes
    near = len(nodes.members_of(view.local_index))
    if nodes.single:
        return Route(route, 1, near, None if route == "direct" else "group"), None
    if route == "direct" and not nodes.uniform:
        return None, (
            f"route='direct' across nodes pairs the members at each node position, and the view's nodes differ "
            f"in size ({nodes}): pass route='allgather' (every member's rows by all-gather, inserted locally)"
        )
    return Route(route, nodes.num_nodes, near, "position" if route == "direct" else "view"), None


class Gather:
    """A writer's all-gather of per-member rows (compact KV or slots), stacked in member order.

    Args:
        route: the writer's route (its ``among`` says whose rows arrive).
        view: the writer's view.
        group: one node: the torch.distributed group of the view's ranks (``None``: the world).
        offnode: across nodes: the view's :class:`~symmsync.spanning.exchange.OffNode` (bounded, failure-aware).
        timeout_s: across nodes: each exchange's budget (the writer's fence's).
    """

    def __init__(
        self,
        route: Route,
        view: PeerView,
        group: dist.ProcessGroup | None,
        offnode: OffNode | None,
        timeout_s: float | None = None,
    ):
        self._among, self._group, self._offnode, self._budget = route.among, group, offnode, timeout_s
        #: How many members' rows arrive: one per node (``"position"``) or every member.
        self.count = route.nodes if route.among == "position" else view.size

    def __call__(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Every gathered member's ``t`` into ``out`` (``count`` times ``t``'s rows), in member
        order (across nodes: node order for ``"position"``, view order for ``"view"``); returns ``out``.

        Raises:
            PeerAborted, FenceTimeout: across nodes, as :meth:`symmsync.spanning.exchange.OffNode.all_gather`.
        """
        if self._offnode is None:
            _all_gather_single(out, t, group=self._group)
        else:
            torch.cat(self._offnode.all_gather(t, among=self._among, timeout_s=self._budget), out=out)
        return out
