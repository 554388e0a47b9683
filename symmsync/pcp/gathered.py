"""The writer's gathered routes: the all-gather route, and every route over nodes.

There a rank's rows reach the replicas it cannot store into as compact KV, by an all-gather
(:class:`~symmsync.pcp.routes.Gather`: torch.distributed within one node, the view's
:class:`~symmsync.spanning.exchange.OffNode` across nodes), and each rank inserts the gathered
rows into the replicas it holds with the writer's kernel. Each member sends a block of
``rows + 1`` rows per write: a header row (slot -1; its first int64 word nonzero when the member
refused the write), then its rows; the kernel skips a refused block. A refused write is also
posted in torch.distributed's store (:class:`~symmsync.spanning.refusals.Refusals`), where the
members read it once their own write of that number is over: no kernel's call header reaches
them across an all-gather. The gathered header rows also set the writer's status word on the
device (:attr:`GatheredWrites.status`), for a runtime to read before it settles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import PeerRefused, peer_refused
from ..spanning.refusals import Refusals
from .batch import Batch
from .kernels import IDX, NOPE, ROPE
from .routes import Gather, Route

_WIDTH = NOPE + ROPE + IDX  # int16 words of a row of compact KV


class GatheredWrites:
    """One writer's gathered writes: its staging, its exchanges and its refusals in the store.

    Args:
        route: the writer's route (:class:`~symmsync.pcp.routes.Route`, ``among`` not ``None``).
        view: the writer's view.
        group: within one node, the torch.distributed group of the view's ranks.
        offnode: across nodes, the view's exchange.
        timeout_s: the writer's fence's budget (each exchange's across nodes).
        rank: this rank (the buffer group's).

    Attributes:
        writes: the writes so far (refused ones too), numbered alike on every member.
        status: the writer's status word on these routes (int64, one element, on the device): 1 once
            a write since the host last settled (:meth:`settle_status`) gathered another member's
            refused block, else 0 (the status word's rule: docs/concepts.md).
    """

    def __init__(self, route: Route, view: Any, group: Any, offnode: Any, timeout_s: float, rank: int):
        self.route = route
        self.gather = Gather(route, view, group, offnode, timeout_s)
        # This rank's own block among the gathered ones (its own refusal is raised to it at once).
        index = view.local_index
        self._own = view.nodes.node_of(index) if route.among == "position" else index
        self.status = torch.zeros(1, dtype=torch.int64, device=view.buffer.device)
        self.refusals = Refusals(view, rank, "writer")
        self.writes = 0
        self.staged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the last batch's blocks
        self._flagged: torch.Tensor | None = None  # a header a refused write set

    def exchange(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The all-gather of ``t`` into ``out``. Across nodes a failed exchange (a peer aborted or
        died, the budget ran out) aborts the view, and so the node view, whose members may
        already wait in this writer's fence (:mod:`symmsync.spanning.parts`)."""
        return self.gather(out, t)

    def stage(self, batch: Batch) -> int:
        """A batch's tensors for the gathered rows (its slots gathered now, collectively, as its
        ``prepare()`` is); returns the rows the kernel takes."""
        rows, device = batch.rows, batch.slots.device
        slots = torch.cat([batch.slots.new_full((1,), -1), batch.slots])
        gathered_slots = slots.new_empty((self.gather.count * (rows + 1),))
        batch.gathered_slots = self.exchange(gathered_slots, slots)
        packed = torch.zeros((rows + 1, _WIDTH), dtype=torch.int16, device=device)
        gathered = torch.empty((gathered_slots.numel(), _WIDTH), dtype=torch.int16, device=device)
        fields = (slice(0, NOPE), slice(NOPE, NOPE + ROPE), slice(NOPE + ROPE, _WIDTH))
        batch._packed = (packed, *[packed[1:, f] for f in fields])
        batch._gathered = (gathered, *[gathered[:, f] for f in fields])
        batch._header = packed[0, :4].view(torch.int64)
        # What a refused write whose batch is bad sends: the last batch's blocks (the one the
        # members write with, prepare() being collective). Not the batch: it refers to the writer.
        self.staged = (packed, gathered, batch._header)
        return gathered_slots.numel()

    def insert(self, layer: int, kv_c: Any, k_pe: Any, indexer_k: Any, batch: Batch | None, launch: Callable) -> None:
        """The exchange of this rank's block and the insert of every member's rows with ``launch``
        (the writer's: ``launch(layer, kv, pe, ix, kv_stride, pe_stride, ix_stride, slots, rows,
        batch)``). ``kv_c`` ``None``: a refused write sends its block with the header set and none
        of its rows (the last prepared batch's block where ``batch`` is ``None``), and inserts only
        with a batch."""
        self.writes += 1
        if batch is None:
            packed, gathered, header = self.staged
        else:
            packed, gathered, header = batch._packed[0], batch._gathered[0], batch._header
        if kv_c is None:
            header.fill_(1)  # the members' kernels skip this block
            self._flagged = header
        else:
            if self._flagged is not None:  # a refused write set a header: good writes send it clear
                self._flagged.zero_()
                self._flagged = None
            _, p_kv, p_pe, p_ix = batch._packed
            p_kv.copy_(kv_c.view(torch.int16))
            p_pe.copy_(k_pe.view(torch.int16))
            p_ix.copy_(indexer_k.view(torch.int16))
        # Bytes travel on every backend (gloo has no int16 all-gather).
        self.exchange(gathered.view(torch.uint8), packed.view(torch.uint8))
        self._note_refused(gathered)
        if batch is None:
            return
        _, g_kv, g_pe, g_ix = batch._gathered
        launch(layer, g_kv, g_pe, g_ix, _WIDTH, _WIDTH, _WIDTH, batch.gathered_slots, gathered.shape[0], batch)

    def _note_refused(self, gathered: torch.Tensor) -> None:
        """Set :attr:`status` to 1 on the device where another member's gathered block is refused:
        the first int64 word of each block's header row (no host synchronization)."""
        headers = gathered.view(self.gather.count, -1, _WIDTH)[:, 0, :4].contiguous().view(torch.int64)[:, 0]
        refused = headers != 0
        refused[self._own] = False
        torch.maximum(self.status, refused.any().to(torch.int64), out=self.status)

    def settle_status(self) -> None:
        """The host settled the writes so far (:meth:`DirectKVWriter.synchronize`): :attr:`status` reads 0."""
        self.status.zero_()

    def post_refusal(self, problem: str, inserts: bool) -> None:
        """Tell the members, through the store, that this rank refuses its next write (``inserts``:
        it still inserts the members' rows into its own replicas)."""
        self.refusals.post(self.writes + 1, problem, "" if inserts else "inserted nothing")

    def refusal_error(self, rank: int, ranks: Any) -> PeerRefused | None:
        """The :class:`~symmsync.PeerRefused` of the members' refused writes this rank has made its
        own write of since it last asked (their records read once), or ``None``."""
        found = self.refusals.read(self.writes)
        if not found:
            return None
        origin, number, why, note = found[0]
        more = f" (and {len(found) - 1} more refused writes since)" if len(found) > 1 else ""
        where = "every replica"
        if note:  # its layer or batch was bad: it inserted nothing, so its replicas lack rows
            if self.route.among == "position":
                where += f" but those of rank {origin}'s node, which lack the rows of the members at its node position"
            else:
                where += f" but rank {origin}'s"
            where += " (its layer or batch was bad)"
        outcome = (
            f"its rows of that layer are in no replica, the other members' rows are in {where}{more}. The writer "
            "goes on: write the layer again on every member, or drop the batch"
        )
        return peer_refused(rank, "DirectKVWriter.write", ranks, f"write {number}", origin, "write", why, outcome)
