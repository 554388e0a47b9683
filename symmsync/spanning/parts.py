"""What a view that spans nodes owns: its node view and its one off-node exchange.

The collectives over such a view and the direct-KV writer run node steps (kernels over the
members of this rank's node) and an exchange between nodes. Both live here, once per view:
:func:`parts_of` makes them the first time a consumer of the view asks (inside that
consumer's constructor, so collectively) and hands the same ones to every later consumer.
They are released with the view: the buffer's ``close()`` shuts the exchange's groups down.

The one home of an abort's way between the two views: an abort of the spanning view (this
rank's own, a waiter's failure, ``close()``) aborts the node view, so that this node's members
waiting in a node step raise :class:`~symmsync.PeerAborted` at once; an abort of the node view
(a node step that failed) aborts the spanning view, which posts it where the other nodes'
members read it (:mod:`.exchange`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.failure import used_after_abort
from .exchange import OffNode

if TYPE_CHECKING:
    from ..core.views import PeerView

#: The key of a spanning view's parts in :attr:`PeerView.owned <symmsync.PeerView.owned>`.
KEY = "spanning"


class SpanningParts:
    """A spanning view's node view and exchange (made by :func:`parts_of`).

    Attributes:
        view: the view that spans nodes.
        node_view: the view of the members on this rank's node (``buf.view`` of them).
        exchange: the view's one :class:`~symmsync.spanning.exchange.OffNode`.
    """

    def __init__(self, view: PeerView, timeout_s: float):
        self.view = view
        members = view.nodes.members_of(view.local_index)
        self.node_view = view.buffer.view([view.ranks[i] for i in members])
        self.exchange = OffNode(view, timeout_s=timeout_s)
        self._taken = 0  # the node view's channels its consumers took, from 0 up
        self._up = _Up(view)  # held here: a failure owner holds its waiters weakly
        view.failure.register(self, "its node view")
        self.node_view.failure.register(self._up, "the view over nodes")

    def take_channels(self, n: int) -> range:
        """The next ``n`` fence channels of :attr:`node_view`, for one consumer (its node steps'
        fences). Consumers are made in one order on every member, so each takes the same ones
        everywhere; a consumer checks :func:`channels_left` first, in its agreement."""
        first = self._taken
        self._taken += n
        return range(first, first + n)

    # ------------------------------------------------------------------ Waiter (of the spanning view)
    def abort_error(self, reason: str) -> Exception:
        return used_after_abort(self.view, "the node steps", reason)

    def refuse_kernel_args(self, reason: str) -> None:
        """This rank aborted the spanning view: abort the node view with the same reason."""
        self.node_view.failure.abort_quietly(reason)

    def release_tables(self) -> None:
        """The buffer closed: nothing of its own to drop (the exchange, a waiter of the view too,
        shuts its groups down itself)."""

    def __repr__(self) -> str:
        return f"SpanningParts(view={list(self.view.ranks)}, node_view={list(self.node_view.ranks)})"


class _Up:
    """A waiter of the node view: its abort aborts the view over nodes."""

    def __init__(self, view: PeerView):
        self._view = view

    def abort_error(self, reason: str) -> Exception:
        return used_after_abort(self._view, "the view over nodes", reason)

    def refuse_kernel_args(self, reason: str) -> None:
        self._view.failure.abort_quietly(reason)


def made(view: PeerView) -> bool:
    """Whether ``view``'s parts exist already (a consumer's agreement compares it: the first
    consumer over nodes makes the node view, collectively over the buffer's group)."""
    return KEY in view.owned


def channels_left(view: PeerView) -> int:
    """How many fence channels of ``view``'s node view no consumer took yet (before its parts are
    made: all of them)."""
    parts = view.owned.get(KEY)
    return view.buffer.cells.channels - (parts._taken if parts is not None else 0)


def parts_of(view: PeerView, *, timeout_s: float | None = None) -> SpanningParts:
    """The node view and exchange of ``view`` (a view that spans nodes), made on first use.

    Collective the first time: every rank of the buffer's group makes its views' first
    consumer over nodes at the same time (a view is collective over the buffer's group), as
    it makes any consumer. Later calls return the same parts.

    Args:
        view: a view whose members span nodes.
        timeout_s: the exchange's budget when this call makes it (default: the backend's fence
            budget); a later consumer's calls wait at most this long in the exchange.
    """
    parts = view.owned.get(KEY)
    if parts is None:
        budget = view.buffer.capabilities.default_timeout_s if timeout_s is None else timeout_s
        parts = view.owned[KEY] = SpanningParts(view, budget)
    return parts
