"""Peer views: the pointer table and cell region of one subgroup of a buffer's ranks.

A :class:`PeerView` is what kernels and fences work with: the base addresses of just
the ranks of a subgroup (in the view's order, so kernels index peers 0..size-1) and
a cell region that belongs to that view alone. Views of disjoint subgroups can
share one buffer, and so can nested ones (a PCP subgroup inside the world): every
view gets its own region, so no fence of one view touches another view's slots.

Views are created collectively over the buffer's group (every rank calls, each
with its own subgroup), which lets every rank check that the members of each view
asked for the same view, in the same order, before anything uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import backends
from ..checks import check_index, is_int, require
from ..errors import ClosedError, ConfigError, ViewError
from . import memory
from . import nodes as _nodes
from .agreement import agree
from .failure import ViewFailure

#: The order of ranks in a TP×PCP layout: ``rank = pcp_rank * tp + tp_rank``.
TP_PCP_ORDER = "rank = pcp_rank * tp + tp_rank"


class PeerView:
    """This rank's view of a subgroup of a :class:`~symmsync.SymmetricBuffer`.

    Attributes:
        buffer: the buffer the view is over.
        ranks: the members' ranks in the buffer's group, in view order.
        size: number of members.
        local_index: this rank's index in :attr:`ranks`.
        region: index of the view's cell region in every member's allocation.
        nodes: the members split into nodes, in view indices (:meth:`symmsync.core.nodes.NodeLayout.restrict`
            of the buffer's layout). A view within one node works as on a one-node buffer; one that
            spans nodes hands out no kernel table (:attr:`ptrs`, :attr:`cell_ptrs`) and takes no
            :class:`~symmsync.Fence` or :class:`~symmsync.Signals`: the collectives and the writer
            (through :class:`symmsync.spanning.exchange.OffNode`) work across its nodes.
        name: the same on every member, and on no other view of the job: the buffer's agreed
            name and the region (where :mod:`symmsync.spanning.exchange` posts an abort).
        failure: the one owner of this rank's abort of the view and of its fences'
            failures (:class:`symmsync.core.failure.ViewFailure`).
        owned: what the layers above the core keep once per view, by key (a view that spans
            nodes: its node view and exchange, :mod:`symmsync.spanning.parts`); each entry
            registers with :attr:`failure` to be aborted and released with the view.
    """

    def __init__(self, buffer: Any, ranks: tuple[int, ...], region: int):
        self.buffer = buffer
        self.ranks = ranks
        self.size = len(ranks)
        self.local_index = ranks.index(buffer.rank)
        self.region = region
        self.nodes: _nodes.NodeLayout = buffer.nodes.restrict(ranks)
        self.name = f"{buffer._key}/{region}"
        # A subset of the buffer's tables, holding the buffer's (and so every mapping they name).
        # The buffer's own, not its properties: those refuse a multi-node buffer's tables, whose
        # off-node entries are 0, and a spanning view refuses its own below.
        table = buffer._ptrs
        self._ptrs: torch.Tensor | None = memory.keep_alive(table[list(ranks)].contiguous(), table)
        cells = buffer._cell_ptrs
        self._cell_ptrs = memory.keep_alive(cells[list(ranks)].contiguous(), cells)
        self.failure = ViewFailure(self)
        self.owned: dict[str, Any] = {}

    # ------------------------------------------------------------------ kernel inputs
    @property
    def rank(self) -> int:
        """This process's rank in the buffer's group."""
        return self.buffer.rank

    @property
    def ptrs(self) -> torch.Tensor:
        """int64 tensor ``[size]`` of the members' base addresses, on the buffer's device.

        Like the buffer's :attr:`~symmsync.SymmetricBuffer.ptrs`, it holds the mappings it
        names alive: kept past ``close()`` it still names mapped memory.
        """
        self._check_open("ptrs")
        _nodes.refuse_table(self.nodes, "ptrs", f"rank {self.rank}: PeerView", "the view")
        return self._ptrs

    @property
    def cell_ptrs(self) -> torch.Tensor:
        """int64 tensor ``[size]``: the bases the cells are offset from, in view order.

        The fence primitives (:mod:`symmsync.language`) take this table with
        :meth:`cell_offset`, never :attr:`ptrs`: for every kind of memory the cells live
        in an allocation of their own, between guards, apart from the user regions. It
        holds the cells alive, as :attr:`ptrs` holds the memory.
        """
        self._check_open("cell_ptrs")
        _nodes.refuse_table(self.nodes, "cell_ptrs", f"rank {self.rank}: PeerView", "the view")
        return self._cell_ptrs

    def release_tables(self) -> None:
        """Drop this view's tables and its waiters' (the buffer's ``close()`` calls it):
        after it, only references users kept hold the mappings."""
        self._ptrs = self._cell_ptrs = None
        self.failure.release_tables()

    def _check_open(self, what: str) -> None:
        if self.buffer.closed:
            raise ClosedError(f"rank {self.rank}: PeerView.{what} used after its buffer was closed")

    def cell_offset(self, channel: int) -> int:
        """Byte offset (from each member's :attr:`cell_ptrs` base) of this view's cell for ``channel``."""
        self._check_channel(channel)
        return self.buffer.cells.cell(self.region, channel)

    def _check_channel(self, channel: int) -> None:
        n = self.buffer.cells.channels
        if not is_int(channel) or not 0 <= channel < n:
            check_index(
                "channel",
                channel,
                n,
                "each view (pass channels= to SymmetricBuffer for more)",
                rank=self.rank,
                call="Fence",
            )

    # ------------------------------------------------------------------ failure
    @property
    def aborted(self) -> str | None:
        """The reason this rank aborted the view with, or ``None`` (kept by :attr:`failure`)."""
        return self.failure.reason

    def abort(self, reason: str) -> None:
        """Give up on this view: tell every member at once, then fail this rank's fences.

        Marks an abort flag in this rank's slot of every channel's cell at every member
        (:func:`symmsync.language.mark_abort`), after writing ``reason`` (UTF-8, cut to
        96 bytes) into this rank's own cell. A member waiting for an epoch this rank has not
        published returns within a poll with :class:`~symmsync.PeerAborted` naming this rank
        and ``reason``; a member that already saw this rank's publish of the epoch it waits
        for completes normally. Afterwards every :class:`~symmsync.Fence` of this rank on
        the view raises :class:`~symmsync.PeerAborted` (naming this rank) at once.
        Idempotent: only the first reason is sent; after ``close()`` (which aborted the view
        with the reason ``"closed"``) it does nothing. A view that spans nodes has no fences:
        its abort is posted in the torch.distributed store, where members of other nodes
        waiting in an :class:`~symmsync.spanning.exchange.OffNode` exchange raise
        :class:`~symmsync.PeerAborted` naming this rank and ``reason``.

        Args:
            reason: why, in a few words (shown in the peers' errors).
        """
        if not isinstance(reason, str):
            require(f"reason must be a str, got {reason!r}", rank=self.rank, call="PeerView.abort")
        self.failure.abort(reason)

    # ------------------------------------------------------------------ host access
    def tensor(
        self, offset: int, shape: Sequence[int] | int, dtype: torch.dtype, index: int | None = None
    ) -> torch.Tensor:
        """:meth:`SymmetricBuffer.tensor` of member ``index`` (default: this rank)."""
        if index is None:
            index = self.local_index
        check_index("index", index, self.size, "the view's members", rank=self.rank, call="PeerView.tensor")
        return self.buffer.tensor(offset, shape, dtype, rank=self.ranks[index])

    def __repr__(self) -> str:
        return f"PeerView(ranks={list(self.ranks)}, local_index={self.local_index}, region={self.region})"


def _parse_request(ranks: Any, me: int, world: int) -> tuple[tuple[int, ...], str | None]:
    try:
        if isinstance(ranks, (str, bytes)) or any(isinstance(r, bool) or int(r) != r for r in ranks):
            raise TypeError
        req = tuple(int(r) for r in ranks)
    except (TypeError, ValueError, OverflowError):
        return (), f"ranks must be a sequence of ints, got {ranks!r}"
    return req, _check_request(req, me, world)


def _check_request(req: tuple[int, ...], me: int, world: int) -> str | None:
    if not req:
        return "a view needs at least one rank (its own)"
    if len(set(req)) != len(req):
        dup = sorted({r for r in req if req.count(r) > 1})
        return f"ranks {list(req)} repeat {dup}"
    out = [r for r in req if not 0 <= r < world]
    if out:
        return f"ranks {out} are outside the group of {world} ranks"
    if me not in req:
        return f"the view {list(req)} excludes the calling rank {me}; each rank passes the subgroup it belongs to"
    return None


def create_view(buffer: Any, ranks: Sequence[int], problem: str | None = None) -> PeerView:
    """This rank's view of ``ranks`` (collective over the buffer's group): the one place
    views are made. :meth:`SymmetricBuffer.view` calls it (and tracks the view for
    ``close()``); ``problem``, when given, is raised on every rank."""
    backends.refuse_compiling("SymmetricBuffer.view")
    me, world = buffer.rank, buffer.world_size
    req: tuple[int, ...] = ()
    if problem is None:
        req, problem = _parse_request(ranks, me, world)
    requests = agree(buffer.group, "view", req, problem=problem, error=ViewError, device=buffer.device)
    _raise_on_differing_requests(requests)
    region = buffer.cells.take_region()
    if region is None:
        raise ViewError(
            f"rank {me}: view: the buffer has cell regions for {buffer.cells.max_views} views and all are "
            "taken; create views once at set-up, or pass a larger max_views to SymmetricBuffer"
        )
    return PeerView(buffer, req, region)


def _raise_on_differing_requests(requests: list[tuple[int, ...]]) -> None:
    """Raise on every rank unless the members of each view asked for it alike (every rank
    checks every view, so that a rank of another view raises too, instead of waiting)."""
    for r, req in enumerate(requests):
        for m in req:
            if requests[m] != req:
                raise ViewError(
                    f"view: rank {r} asked for a view of {list(req)} but its member rank {m} asked for "
                    f"{list(requests[m])}; every member must pass the same ranks in the same order"
                )


def tp_pcp_ranks(rank: int, tp: int, pcp: int) -> tuple[list[int], list[int]]:
    """The PCP and TP subgroups of ``rank`` in a ``tp × pcp`` layout.

    Ranks are numbered ``rank = pcp_rank * tp + tp_rank``: the TP ranks of one PCP
    rank are consecutive, and a PCP subgroup is the ranks with the same TP rank.

    Returns:
        ``(pcp_group, tp_group)``: the ranks of ``rank``'s PCP subgroup, ordered by
        PCP rank, and of its TP subgroup, ordered by TP rank.
    """
    for name, v in (("rank", rank), ("tp", tp), ("pcp", pcp)):
        if not is_int(v):
            raise ConfigError(f"tp_pcp_ranks: {name} must be an int, got {v!r}")
    if tp <= 0 or pcp <= 0:
        raise ConfigError(f"tp and pcp must be positive, got tp={tp}, pcp={pcp}")
    if not 0 <= rank < tp * pcp:
        raise ConfigError(f"rank {rank} is outside a tp={tp} × pcp={pcp} layout of {tp * pcp} ranks")
    tp_rank, pcp_rank = rank % tp, rank // tp
    return [k * tp + tp_rank for k in range(pcp)], [pcp_rank * tp + t for t in range(tp)]


def pcp_view(buffer: Any, tp: int = 1) -> PeerView:
    """This rank's PCP subgroup view in a TP×PCP layout (collective over the buffer's group).

    With ``world = tp * pcp`` ranks numbered ``rank = pcp_rank * tp + tp_rank``, the
    PCP subgroup of a rank is every rank with the same ``tp_rank``, ordered by
    ``pcp_rank``; its :attr:`PeerView.local_index` is the rank's PCP rank.
    """
    return _layout_view(buffer, tp, pcp=True)


def tp_view(buffer: Any, tp: int) -> PeerView:
    """This rank's TP subgroup view in a TP×PCP layout (collective; see :func:`pcp_view`)."""
    return _layout_view(buffer, tp, pcp=False)


def _layout_view(buffer: Any, tp: Any, pcp: bool) -> PeerView:
    if buffer.closed:
        raise ClosedError(f"rank {buffer.rank}: {'pcp' if pcp else 'tp'}_view used after the buffer was closed")
    world = buffer.world_size
    if not is_int(tp) or tp <= 0 or world % tp:
        # Still enter the exchange, so that every rank raises instead of some waiting.
        return create_view(buffer, (), problem=f"tp={tp!r} must be a positive divisor of the world size {world}")
    pcp_group, tp_group = tp_pcp_ranks(buffer.rank, tp, world // tp)
    return buffer.view(pcp_group if pcp else tp_group)
