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

And the one watch of the store for this node: a member that waits in a node step waits for
its node peers alone, and one of them that died (``os._exit``, killed) never marks its
flags. So while a spanning view is open, a thread of this process (one for all its spanning
views, started by the first, ended with the last's ``close()``; a daemon, which never keeps
the process alive) reads the view's origin in the store (:func:`.exchange.origin`, which a
member of any node claims before it tells anyone of its abort, or for a member it found dead)
every :data:`WATCH_S`; when the origin is a node peer, it sets that peer's abort flag in this
rank's own cells of the node view (every channel, a plain store), so that a node step
waiting for it fails at once with :class:`~symmsync.PeerAborted`, as if the peer had marked it
itself; a wait for a peer that published its epoch before still completes. It launches no
kernel (Triton's interpreter is not thread-safe) and touches nothing else: the call that
fails aborts the views on its own thread, and its error names the origin
(:func:`.exchange.origin_error`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch

from ..core.failure import used_after_abort
from ..errors import PeerAborted
from ..language import cells
from . import exchange
from .exchange import OffNode

if TYPE_CHECKING:
    from ..core.views import PeerView

log = logging.getLogger("symmsync")

#: The key of a spanning view's parts in :attr:`PeerView.owned <symmsync.PeerView.owned>`.
KEY = "spanning"

#: How often this process's watch reads each open spanning view's origin in the store, in seconds.
WATCH_S = 0.05


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
        self._up = _Up(view, self.node_view)  # held here: a failure owner holds its waiters weakly
        view.failure.register(self, "its node view")
        self.node_view.failure.register(self._up, "the view over nodes")
        #: The view's origin once the watch read it (``(global rank, reason)``), else ``None``.
        self.origin: tuple[int, str] | None = None
        self._lock = threading.Lock()  # the watch's store into the cells, against close()
        self._cells: torch.Tensor | None = view.buffer.cell_memory().view(torch.int64)
        self._globals = exchange.global_ranks(view)
        _watch(self)

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
        """This rank aborted the spanning view: abort the node view with the same reason (and
        stop watching: every call fails from now on)."""
        _unwatch(self)
        self.node_view.failure.abort_quietly(reason)

    def release_tables(self) -> None:
        """The buffer closed: stop watching and drop the cells (the exchange, a waiter of the
        view too, shuts its groups down itself)."""
        _unwatch(self)
        with self._lock:
            self._cells = None

    # ------------------------------------------------------------------ the watch
    def look(self) -> None:
        """One read of the view's origin (the watch's thread); the first seen is acted on once."""
        if self.origin is not None:
            return
        first = exchange.origin(self.view)
        if first is None:
            return
        self.origin = first
        _unwatch(self)
        self.flag(first[0])

    def flag(self, rank: int) -> None:
        """Set the abort flag of global ``rank``, when it is a node peer, in this rank's own cells
        of the node view (every channel): this rank's node steps stop waiting for it."""
        if rank not in self._globals:
            return
        member = self.view.ranks[self._globals.index(rank)]
        node = self.node_view
        if member == self.view.rank or member not in node.ranks:
            return
        j = node.ranks.index(member)
        words = [(node.cell_offset(c) + cells.SLOTS) // 8 + j for c in range(self.view.buffer.cells.channels)]
        with self._lock:
            if self._cells is None:  # closed
                return
            where = torch.tensor(words, dtype=torch.int64, device=self._cells.device)
            buf = self.view.buffer
            if not buf.capabilities.streams:
                self._cells[where] |= cells.ABORT_FLAG
                return
            with torch.cuda.device(buf.device):  # a side stream: the current one may hold the waiting step
                side = torch.cuda.Stream(buf.device)
                with torch.cuda.stream(side):
                    self._cells[where] |= cells.ABORT_FLAG
                side.synchronize()

    def __repr__(self) -> str:
        return f"SpanningParts(view={list(self.view.ranks)}, node_view={list(self.node_view.ranks)})"


class _Up:
    """A waiter of the node view: its abort aborts the view over nodes."""

    def __init__(self, view: PeerView, node_view: PeerView):
        self._view = view
        self._node = node_view

    def abort_error(self, reason: str) -> Exception:
        return used_after_abort(self._view, "the view over nodes", reason)

    def refuse_kernel_args(self, reason: str) -> None:
        # A node view's abort that relays a node peer's (one found dead by core/liveness.py, one
        # whose flag a node step saw) relays it over nodes too: its origin is claimed, not this rank.
        origin = self._node.failure.relayed
        cause = None
        if origin is not None:
            cause = PeerAborted(reason, rank=self._view.rank, epoch=-1, late={}, channel=-1, aborted=dict([origin]))
        self._view.failure.abort_quietly(reason, cause=cause)


_WATCHED: weakref.WeakSet[SpanningParts] = weakref.WeakSet()
_WATCH_LOCK = threading.Lock()
_watcher: list[threading.Thread] = []  # the running watch, if any


def _watch(parts: SpanningParts) -> None:
    with _WATCH_LOCK:
        _WATCHED.add(parts)
        if not _watcher:
            _watcher.append(threading.Thread(target=_watch_loop, name="symmsync-spanning-watch", daemon=True))
            _watcher[0].start()


def _unwatch(parts: SpanningParts) -> None:
    with _WATCH_LOCK:
        _WATCHED.discard(parts)


def _watch_loop() -> None:
    """The watch's thread: every open spanning view's origin, every :data:`WATCH_S`; it ends when
    no view is left to watch (the next one starts it again)."""
    while True:
        with _WATCH_LOCK:
            live = list(_WATCHED)
            if not live:
                _watcher.clear()
                return
        for parts in live:
            try:
                parts.look()
            except Exception as e:  # noqa: BLE001 - a watch must not die of one view's trouble
                log.debug("the watch of view %s failed: %s", list(parts.view.ranks), e)
        del live, parts
        time.sleep(WATCH_S)


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
