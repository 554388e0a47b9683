"""The PCP direct-KV writer: quantize once, write the final cache bytes into every replica.

Two routes, chosen explicitly and agreed by every rank (never a silent mix):

``"direct"``
    Each rank quantizes its own rows and stores the final cache bytes into every
    member of its PCP peer view through the view's pointer table; one fence per
    layer makes them visible. By default (``fused=True``) the fence's publish and
    wait run in the writer's tail (:func:`symmsync.language.grid_fence`): a layer is
    one launch.
``"allgather"``
    The baseline runtimes ship: all-gather the bf16 inputs over the PCP group
    (torch.distributed), then run the same quantize-and-insert kernel locally on
    the gathered rows. It is the byte oracle of the direct route.

On a view that spans nodes the two names are read against its node layout
(:mod:`symmsync.pcp.routes`): ``"direct"`` is direct within the writer's node and an
all-gather of the compact KV between nodes, in the same ``write()``.

Both routes run the same kernel, so their bytes can be compared exactly; the tests
also check every cache format (``CacheLayout(main_scale=..., indexer_scale=...)``,
picked at compile time) against references written in plain torch from the format
rules.

Eager cost: :meth:`DirectKVWriter.prepare` does every check that needs the slot
values; the first :meth:`~DirectKVWriter.write` of a batch packs the kernel launch
(:meth:`symmsync.core.launch.Launcher.bind`) and later layers pass it what a layer changes
(:class:`symmsync.core.launch.BoundLaunch`): the layer's offsets, and the input addresses when
the inputs moved. With the fence fused (the default), a layer is one
launch.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import triton

from .. import backends
from ..checks import int_problem, is_int, require
from ..core import agreement
from ..core.calls import call_fence_kernel
from ..core.consumer import Consumer
from ..core.fence import Fence
from ..core.launch import Launcher, kernel_view
from ..errors import ConfigError, InputError, SymmSyncError
from ..language import INTERPRETED
from ..ops import oplib
from ..spanning import exchange
from ..spanning import parts as spanning
from . import making
from .batch import CLONED, Batch, check_duplicates, slots_problem, usable_blocks, write_problem
from .gathered import GatheredWrites
from .kernels import IDX as _IDX
from .kernels import NOPE as _NOPE
from .kernels import ROPE as _ROPE
from .kernels import _quantize_write_kernel
from .layout import CacheLayout, CacheTensors, layer_spans
from .quant import INDEXER_SCALES
from .routes import ROUTES
from .tuning import Tuning

if TYPE_CHECKING:
    from ..core.views import PeerView

__all__ = ["ROUTES", "Batch", "DirectKVWriter", "Tuning"]


class DirectKVWriter(Consumer):
    """Writes a PCP group's KV-cache bytes into every replica, one layer at a time.

    Args:
        view: this rank's PCP peer view (``symmsync.pcp_view(buffer, tp)``).
        layout: where every layer's caches live in the view's buffer: a
            :class:`~symmsync.pcp.CacheLayout` packed in it, or the runtime's own per-layer
            cache tensors (:class:`~symmsync.pcp.CacheTensors`) anywhere inside it (memory
            symmsync allocated, or registered); the members of a PCP group must hold them
            at the same offsets.
        route: ``"direct"`` or ``"allgather"``; every rank must pass the same. On a view
            that spans nodes, ``"direct"`` is direct within each node and an all-gather
            between nodes (:mod:`symmsync.pcp.routes`).
        fused: direct route only: publish and wait in the writer's tail, so that a layer
            is one launch (default on the direct route; ``False``: the writer, then a
            fence launch).
        group: the torch.distributed group of the view's ranks; needed by the allgather
            route when the view is within one node and is not the whole world (across
            nodes the writer uses the view's :class:`~symmsync.spanning.exchange.OffNode`).
        channel: the fence channel of the view the writer uses (across nodes: checked and
            agreed, and the writer's fence takes the next channel of the view's node view,
            :mod:`symmsync.spanning.parts`).
        timeout_s: fence wait budget (default: the backend's).
        debug: also check, at :meth:`prepare`, that no slot is claimed twice across the
            PCP group (one more exchange per batch).
        tuning: how the kernel is launched (:class:`Tuning`; default ``Tuning()``).
        block_rows: shorthand for the :class:`Tuning` field (``None``: the tuning's).
        num_warps: shorthand for the :class:`Tuning` field (``None``: the tuning's).
        programs_per_sm: shorthand for the :class:`Tuning` field (``None``: the tuning's).
        spread: shorthand for the :class:`Tuning` field (``None``: the tuning's).

    Construction is collective over the buffer's group: every rank agrees on the route
    (and on whether its view spans nodes), and the members of a PCP group on the layout
    (formats included) and the channel. The writer's :attr:`fence` is a
    :class:`~symmsync.Fence` on both routes: on the view, or, when the view spans nodes,
    on :attr:`node_view` (the members on this rank's node; a fence cannot span nodes).

    Raises:
        ConfigError: on every rank, when any rank passed an argument it cannot take (such as
            ``route="direct"`` on a view whose nodes differ in size), or the ranks disagree
            (also: some views span nodes and others do not) (:class:`~symmsync.BoundsError`,
            a ``ConfigError``, when the layout does not fit or the channel is not the view's).
        BackendError: on every rank, when a rank of the group died or left before the
            arguments were agreed.
    """

    NAME = "DirectKVWriter"
    KINDS = ("write",)
    WORDS = ("layer", "rows")
    REFUSED_OUTCOME = (
        "the refusing member wrote nothing of the layer, and which of its slots it lacks cannot be known (the "
        "members' writes of it ran: their rows are in every replica); the writer goes on: write the layer again "
        "on every member, or drop the batch"
    )

    def __init__(
        self,
        view: PeerView,
        layout: CacheLayout | CacheTensors,
        *,
        route: str = "direct",
        fused: bool | None = None,
        group: dist.ProcessGroup | None = None,
        channel: int = 0,
        timeout_s: float | None = None,
        debug: bool = False,
        tuning: Tuning | None = None,
        block_rows: int | None = None,
        num_warps: int | None = None,
        programs_per_sm: int | None = None,
        spread: bool | None = None,
    ):
        agreed = making.make(
            view, layout, route, fused, group, channel, timeout_s, tuning,
            block_rows=block_rows, num_warps=num_warps, spread=spread, programs_per_sm=programs_per_sm,
        )  # fmt: skip
        make, how, fused, placement, tuning, fence = (
            agreed.make,
            agreed.route,
            agreed.fused,
            agreed.placement,
            agreed.tuning,
            agreed.fence,
        )
        buf = make.buffer
        self.view, self.layout, self.route, self.fused, self.debug = view, layout, route, fused, debug
        one_node = how.among is None  # direct within one node: its kernels fence themselves
        self.made(make, where=f"DirectKVWriter (channel {channel})", memory=f"the cache on {buf.device}",
                  no_grad="write() has", calls=one_node)  # fmt: skip
        #: Across nodes, the members of the view on this rank's node (:attr:`fence`'s view); else ``None``.
        self.node_view = None
        offnode = None
        if how.spans:
            # The view's own node view and exchange (made by its first consumer over nodes, after
            # every rank agreed to: a view is collective over the buffer's group); the fence takes
            # the node view's next channel.
            parts = spanning.parts_of(view, timeout_s=timeout_s)
            self.node_view, offnode = parts.node_view, parts.exchange
            (node_channel,) = parts.take_channels(1)
            fence, problem, error = agreement.attempt(
                lambda: Fence(self.node_view, node_channel, timeout_s=timeout_s), buf.rank
            )
            agreement.agree(buf.group, "DirectKVWriter", {}, problem=problem, error=error)
        #: Across nodes, the view's off-node exchange (:class:`~symmsync.spanning.exchange.OffNode`);
        #: ``None`` otherwise.
        self.offnode = offnode
        self._route = how
        #: The gathered routes' writes (:mod:`symmsync.pcp.gathered`), or ``None`` (direct within one node).
        self._gathered = None
        if how.among is not None:
            self._gathered = GatheredWrites(how, view, group, offnode, fence.timeout_s, buf.rank)
        self.group = group
        #: How the kernel is launched (:class:`Tuning`).
        self.tuning = tuning
        block_rows, spread = tuning.block_rows, bool(tuning.spread)
        self.block_rows = block_rows
        #: The fence of the writer's channel on its view (across nodes: on :attr:`node_view`). The
        #: direct route fences with it after every layer; the all-gather route does not need it
        #: (the all-gather orders its rows) but it is there on both routes, for other peer traffic.
        self.fence = fence
        near = self.node_view if how.spans else view  # the replicas this rank can store into
        if route == "direct":
            dst = near.ptrs
        else:
            dst = near.ptrs[near.local_index : near.local_index + 1].contiguous()
        self._dst = dst
        caps = buf.capabilities
        self._ways = dst.numel() if spread else 1  # the grid's second axis: one destination each
        # A GPU: one persistent grid fills its multiprocessors (programs_per_sm 0: one program per
        # work item); the interpreter runs programs one after another.
        self._max_programs = self.device_programs(tuning.programs_per_sm, 4)
        # Within one node: the write's call header and fence apart from the kernel (fused=False), and
        # what a refused write launches instead of the kernel (its header refused, nothing stored).
        self._call_fence = None
        if one_node:
            self._call_fence = self.bind(
                call_fence_kernel, per_call=("a", "b"), num_warps=1, **fence.kernel_kwargs, c=0, d=0,
                KIND=0, SIZE=view.size, TRAP=caps.traps,
            )  # fmt: skip
        self._launcher = Launcher(
            _quantize_write_kernel,
            (1,),
            num_warps=tuning.num_warps,
            NDST=dst.numel(),
            BLOCK_T=block_rows,
            BLOCK_SIZE=layout.block_size,
            FUSED=self.fused,
            TRAP=caps.traps,
            MAIN_POW2=layout.main_scale == "pow2",
            IDX_SCALE=INDEXER_SCALES.index(layout.indexer_scale),
            SPREAD=spread,
            PREFETCH=tuning.programs_per_sm > 0,  # a program with several items loads the next one early
            GATHERED=self._gathered is not None,
            HEADER=one_node,
        )
        self._fences_node = route == "direct" and self._gathered is not None  # across nodes: a node fence per write
        self._num_layers = layout.num_layers
        # Per-layer region offsets and the block strides, computed once.
        self._offsets = list(placement.offsets)
        self._strides = (placement.main_block_stride, placement.indexer_block_stride)
        self._usable = (-1, 0)  # (buffer size, blocks usable at that size)
        self._spans: list[torch.Tensor] | None = None  # made once every block is mapped (prepare)
        self._last_batch: weakref.ReferenceType | None = None  # weak: a batch refers to its writer

    # ------------------------------------------------------------------ lifetime
    def release(self, together: bool) -> None:
        self._spans = None
        super().release(together)

    # ------------------------------------------------------------------ per batch
    def prepare(self, slot_mapping: torch.Tensor) -> Batch:
        """Validate this rank's slot mapping (collective over the buffer's group).

        Raises:
            InputError: on every rank, when any rank's mapping has the wrong dtype,
                device or shape, a slot outside ``[-1, num_slots)``, a different number
                of rows than the others, or (``debug``) a slot claimed twice.
            BackendError: on every rank, when a rank of the group died or left.
        """
        buf = self.buffer
        call = "DirectKVWriter.prepare"
        backends.refuse_compiling(call)
        if self._closed or self.buffer.closed:
            self.check_usable()
        usable = self._usable_blocks()
        slots, problem = slots_problem(slot_mapping, buf.device, self.layout, usable, buf.nbytes)
        rows = slots.numel() if slots is not None else -1
        members = tuple(self.view.ranks)
        every = agreement.agree(
            buf.group,
            call,
            {"the row count": rows, "slots": slots.cpu() if self.debug and slots is not None else None},
            problem=problem,
            error=InputError,
            device=buf.device,
            same={
                "the row count": agreement.Same(
                    error=InputError,
                    among=members,
                    hint="ranks of a PCP group must have equal row counts: "
                    "pad with slot -1 (symmsync.pcp.pcp_split does)",
                )
            },
        )
        if self.debug:
            check_duplicates(members, [every[r]["slots"] for r in members])
        batch = Batch(slots=slots, rows=rows, writer=self)  # write() takes only batches this writer validated
        launched_rows = rows
        if self._gathered is not None:  # the rows this rank inserts arrive by all-gather
            launched_rows = self._gathered.stage(batch)
        batch._grid = self._grid_for(launched_rows)
        self._last_batch = weakref.ref(batch)  # what a compiled write() names by its slots
        if self._spans is None and self._usable_blocks() == self.layout.num_blocks:
            self._spans, self._caches = layer_spans(buf, self.layout)  # what a compiled write() declares it mutates
        return batch

    def caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(main_kv, indexer_k)`` of ``layer`` (the layout's), views of the span a compiled
        :meth:`write` passes its op (:mod:`symmsync.pcp.torch_ops`): read them in compiled code so that
        the reads come after the write. Made by the first ``prepare()`` with every block in mapped memory.

        Raises:
            BoundsError: ``layer`` is not one of the layout's layers.
            ConfigError: no such ``prepare()`` yet.
        """
        self.layout.check_layer(layer)
        if self._spans is None:
            problem = f"{self._usable_blocks()} of the {self.layout.num_blocks} blocks are mapped: prepare() first"
            require(problem, rank=self.buffer.rank, call="DirectKVWriter.caches")
        return self._caches[layer]

    def span(self, layer: int) -> torch.Tensor:
        """The span of this rank's memory that holds ``layer``'s caches (uint8): what a compiled
        :meth:`write` passes its op as the tensor it mutates (:mod:`symmsync.pcp.torch_ops`).

        Raises: as :meth:`caches`.
        """
        spans = self._spans
        if spans is not None and is_int(layer) and 0 <= layer < len(spans):  # a compiled write's every call
            return spans[layer]
        self.caches(layer)
        return spans[layer]

    @property
    def usable_blocks(self) -> int:
        """Blocks of every layer that lie inside the buffer's user region now: a cache
        over a growable buffer or a runtime's registered memory may reach into address
        space not mapped yet, and :meth:`prepare` refuses slots there until a grow."""
        return self._usable_blocks()

    def _usable_blocks(self) -> int:
        nbytes = self.buffer.nbytes
        if self._usable[0] != nbytes:
            self._usable = (nbytes, usable_blocks(self.layout, self._offsets, self._strides, nbytes))
        return self._usable[1]

    def _grid_for(self, rows: int) -> tuple[int, int, int]:
        """The grid for ``rows`` rows: one program at least (the fused tail must run)."""
        items = triton.cdiv(rows, self.block_rows)
        if self._max_programs:
            items = min(items, self._max_programs)
        return (max(1, items), self._ways, 1)

    # ------------------------------------------------------------------ per layer
    def write(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, indexer_k: torch.Tensor, batch: Batch) -> None:
        """Quantize this rank's rows of ``layer`` and make them visible in every replica.

        Direct route: one writer launch into every member's replica, its tail a fence
        (or, with ``fused=False``, a fence launch after it); on return (in stream order), every replica of the PCP group
        holds the layer's bytes of every member's rows. Allgather route: an all-gather
        of the inputs, then an insert into this rank's replica; on return this rank's
        replica holds every member's rows (each member fills its own replica: read a
        peer's replica only after a fence, e.g. ``writer.fence.fence()``).

        The launch is packed at a batch's first write; later layers change only what
        differs: the layer's offsets, and the input addresses for other tensors.

        A bad input fails that write on every member and nothing else (:meth:`refuse`), on
        every route, within one node and over nodes: this rank sends none of its rows and
        raises the error below; the members' writes of the layer raise
        :class:`~symmsync.PeerRefused` naming it and its problem (at once on the host backend,
        at :meth:`synchronize` on GPUs), and the next write of every member goes on.

        Raises:
            BoundsError: ``layer`` is not one of the layout's layers, as
                ``layout.main_offset(layer)`` raises (a ``layer`` that is not an int:
                :class:`~symmsync.ConfigError`, as there).
            InputError: wrong dtype, shape, device, or non-contiguous input, an input that
                requires grad while grad mode is on (no autograd formula), or a batch that
                this writer's :meth:`prepare` did not return.
            ClosedError: the buffer was closed.
            CaptureError: across nodes, during CUDA graph capture (nothing aborted).
            PeerRefused: another member refused its write of this layer (:meth:`refuse`; on the
                host backend here, on GPUs at :meth:`synchronize`).
        """
        if torch.compiler.is_compiling():  # the op for the backend (symmsync.pcp.torch_ops)
            return self._traced_write(layer, kv_c, k_pe, indexer_k, batch)
        self.eager_write(layer, kv_c, k_pe, indexer_k, batch)

    def _traced_write(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, indexer_k: torch.Tensor, batch: Batch):
        """What :meth:`write` puts in the graph Dynamo traces: the op for its backend
        (:mod:`symmsync.pcp.torch_ops`: ``kv_write_in_order`` under ``aot_eager``, else ``kv_write``)."""
        span = self.span(layer)  # refuses a writer without caches
        if oplib.backend_runs_in_order():
            orders = self.fence.orders()
            return torch.ops.symmsync.kv_write_in_order(
                self.op_handle, layer, kv_c, k_pe, indexer_k, batch.slots, span, orders
            )
        return torch.ops.symmsync.kv_write(self.op_handle, layer, kv_c, k_pe, indexer_k, batch.slots, span)

    def last_batch(self) -> Batch | None:
        """The :class:`Batch` that :meth:`prepare` returned last, while it is alive (what a compiled
        write names by its ``slots``), else ``None``."""
        return self._last_batch() if self._last_batch is not None else None

    def compiled_write(
        self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, indexer_k: torch.Tensor, slots: torch.Tensor,
        cache: torch.Tensor,
    ) -> None:  # fmt: skip
        """What the ops of a compiled :meth:`write` run (:mod:`symmsync.pcp.torch_ops`): check that
        ``cache`` is this writer's span of ``layer`` (not a clone functionalization made: :data:`CLONED`)
        and ``slots`` the last batch's (what the graph cannot have checked), then :meth:`eager_write`.
        A refusal fails that write on every member (:meth:`refuse`), as a bad input does."""
        problem = None
        if is_int(layer) and 0 <= layer < self.layout.num_layers:  # else the write raises the layout's error
            if cache.data_ptr() != self.span(layer).data_ptr():
                problem = CLONED.format(layer=layer)
        batch = self._last_batch() if self._last_batch is not None else None
        stale = batch is None or batch.slots.data_ptr() != slots.data_ptr() or batch.rows != slots.shape[0]
        if problem is None and stale:
            problem = "a compiled write() takes the Batch that this writer's prepare() returned last (once per batch)"
        if problem is not None:  # the members may already wait in this layer's synchronization
            self.refuse(problem, "write (compiled)", ConfigError, layer, batch if not stale else None)
        self.eager_write(layer, kv_c, k_pe, indexer_k, batch)

    def eager_write(
        self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, indexer_k: torch.Tensor, batch: Batch
    ) -> None:
        """The checked write, launched now: what :meth:`write` runs outside compiled code and its ops
        (:mod:`symmsync.pcp.torch_ops`) run when a compiled graph calls them."""
        if self._closed:
            self.check_usable()
        if self.offnode is not None:  # before anything is written or aborted
            self.offnode.refuse_capture(self.buffer.device, "DirectKVWriter.write")
        bad = write_problem(self, layer, kv_c, k_pe, indexer_k, batch)
        if bad is not None:  # InputError, BoundsError: every bad input, each named, before anything is written
            error, problem = bad
            self.refuse(problem, "write", error, layer, batch)
        if not self._failure.clean:
            self.check_usable()
        try:
            self._write_checked(layer, kv_c, k_pe, indexer_k, batch)
        except SymmSyncError as e:  # across nodes, the node fence's failure reaches the other nodes too
            err = self._spanning_error(e)
            if err is e:
                raise
            raise err from e
        if self._host_checks:  # the host backend: the launches are over
            if self._gathered is None:
                self.settle()  # a failed wait, members' writes that differ, a member's refused write
            elif self.view.size > 1:
                self._raise_refusals()  # the store's records of the members' refused writes

    def _spanning_error(self, e: SymmSyncError) -> Exception:
        """A write's failed step as the write's error: across nodes it fails the writer, naming the
        view's origin (a node fence names the node peer whose flag it saw); else ``e``."""
        if self.node_view is None:
            return e
        err = exchange.as_origin(self.view, self.buffer.rank, "DirectKVWriter.write", e)
        self.fail(err, str(err))
        return err

    def refuse(self, problem: str, call: str = "write", error: type = InputError, layer: Any = None,
               batch: Any = None) -> None:  # fmt: skip
        """Refuse a write whose arguments failed this rank's checks: that write fails on every
        member, and nothing else.

        This rank still takes its part of the write's synchronization, marked refused, having
        sent none of its rows: on the direct route within one node the write's call header and
        fence, its header refused with ``problem`` (:meth:`launch_refused`); on the gathered routes
        (the all-gather route, and any view over nodes) its part of the exchange, a block whose
        header says refused, so that no member inserts its rows, after telling the members through
        torch.distributed's store. It raises ``error`` here, and the members' writes of the layer,
        which ran, raise :class:`~symmsync.PeerRefused` naming this rank and ``problem`` (at once on
        the host backend, at :meth:`synchronize` on GPUs; the writer's :attr:`~symmsync.Consumer.status`
        word says so at once on the device). The epochs stay in step and the writer stays usable.
        ``layer`` and ``batch``: the refused call's (a gathered route still inserts the members'
        rows into this rank's replica where they are good)."""
        gathered = self._gathered
        if gathered is None:
            return super().refuse(problem, call, error)
        self.check_usable()
        err = self.refusal(problem, call, error)
        if gathered.staged is None:  # nothing prepared yet: no member can be in a write (prepare() is collective)
            raise err
        takes = self._takes(layer, batch)  # its layer and batch are good: it inserts the members' rows
        gathered.post_refusal(problem, takes)
        try:
            gathered.insert(layer, None, None, None, batch if takes else None, self._launch)
            if self._fences_node and not (self.fused and takes):
                self.fence.fence()  # the node's fence, which no fused launch ran
            elif self._fences_node and self._host_checks:
                self.fence.check()
        except SymmSyncError as e:  # the exchange or the node fence failed: that is this write's error
            raise self._spanning_error(e) from err
        raise err

    def launch_refused(self, call: str, refused: int) -> None:
        """The write's call header, refused, and its fence, in place of the kernel (one node)."""
        self._call_fence(0, 0, refused)

    def _takes(self, layer: Any, batch: Any) -> bool:
        """Whether a refused write's ``layer`` and ``batch`` are good enough to insert the members' rows."""
        return type(layer) is int and 0 <= layer < self._num_layers and type(batch) is Batch and batch.writer is self

    def synchronize(self) -> None:
        """Wait for the device; raise a failed wait's error (:meth:`symmsync.Fence.synchronize`),
        then :class:`~symmsync.PeerRefused` for a layer another member refused (:meth:`refuse`)
        since the last call: its rows of that layer are in no replica. The writer stays usable.
        Members' writes that differ (another layer, other rows: within one node) raise
        :class:`~symmsync.CallMismatch` here on GPUs, and the writer fails."""
        if self._gathered is None:
            return super().synchronize()
        self.check_usable()
        if self.buffer.capabilities.streams:
            self.fence.synchronize()  # every write this rank made has run (and so every exchange)
        self._raise_refusals()

    @property
    def status(self) -> Any:
        """The writer's status word (:attr:`symmsync.Consumer.status`); on the gathered routes 1 once
        a write gathered another member's refused block (:mod:`symmsync.pcp.gathered`)."""
        return super().status if self._gathered is None else self._gathered.status

    def _raise_refusals(self) -> None:
        """Raise :class:`~symmsync.PeerRefused` for the members' refused writes this rank has made its
        own write of since the last time it asked, once: the store's records (gathered routes). The
        host has settled those writes: the status word reads 0 again."""
        self._gathered.settle_status()
        err = self._gathered.refusal_error(self.rank, self.view.ranks)
        if err is not None:
            raise err

    def _write_checked(self, layer: int, kv_c, k_pe, indexer_k, batch: Batch) -> None:
        if self.route == "allgather":
            return self._gathered.insert(layer, kv_c, k_pe, indexer_k, batch, self._launch)
        if self.fused:  # the tail fences inside the kernel: refuse here what Fence.fence() would
            self.fence.check_usable()
        if self._gathered is not None:  # across nodes: its rows and its position peers', into its node's replicas
            self._gathered.insert(layer, kv_c, k_pe, indexer_k, batch, self._launch)
        else:
            if INTERPRETED:  # numpy has no bfloat16: the rows travel as their bits (no call on a GPU's hot path)
                kv_c, k_pe, indexer_k = kernel_view(kv_c), kernel_view(k_pe), kernel_view(indexer_k)
            self._launch(layer, kv_c, k_pe, indexer_k, _NOPE, _ROPE, _IDX, batch.slots, batch.rows, batch)
            if not self.fused:  # the write's call header and its fence, apart from the kernel
                self._call_fence(layer, batch.rows, 0)
            return
        if not self.fused:
            self.fence.fence()
        elif self._host_checks:
            self.fence.check()

    def accepts(self, layer: Any, kv_c: Any, k_pe: Any, indexer_k: Any, batch: Any) -> bool:
        """Whether ``write(layer, kv_c, k_pe, indexer_k, batch)`` passes this rank's input checks:
        False exactly when it would raise :class:`~symmsync.InputError`, or the layout's
        :class:`~symmsync.BoundsError` / :class:`~symmsync.ConfigError` for ``layer`` (and refuse the
        write on every member: :meth:`refuse`), by the rule the write checks with. It says nothing of the other members'
        writes, nor of a writer whose view was aborted or whose buffer was closed."""
        return write_problem(self, layer, kv_c, k_pe, indexer_k, batch) is None

    #: The kernel arguments a layer's call passes the batch's bound launch (by name; the
    #: launcher knows their positions).
    _PER_LAYER = ("kv_c", "k_pe", "idx_k", "main_off", "idx_off", "layer", "refused")

    def _launch(self, layer, kv_c, k_pe, idx_k, kv_stride, pe_stride, ix_stride, slots, rows, batch) -> None:
        if self.buffer.closed:
            self.check_usable()
        main_off, idx_off = self._offsets[layer]
        bound = batch._bound
        if bound is None:
            args = dict(
                zip(("ptrs", "cell", "me", "timeout_ns", "record"), self.fence.kernel_args),
                calls=self.calls.kernel_args[0] if self.calls is not None else self.fence.kernel_args[0],
                kv_c=kv_c,
                k_pe=k_pe,
                idx_k=idx_k,
                kv_stride=kv_stride,
                pe_stride=pe_stride,
                ix_stride=ix_stride,
                slots=slots,
                n_rows=rows,
                dst=self._dst,
                main_off=main_off,
                idx_off=idx_off,
                main_bstride=self._strides[0],
                idx_bstride=self._strides[1],
                per_member=batch.rows + 1,  # GATHERED: a member's header row, then its rows
            )
            bound = batch._bound = self._launcher.bind_named(grid=batch._grid, per_call=self._PER_LAYER, **args)
        # The bound launch repacks only what changed since the batch's last write: a runtime
        # that keeps its inputs in the same buffers changes only the layer's offsets.
        try:
            bound(kv_c, k_pe, idx_k, main_off, idx_off, layer, 0)
        except Exception as e:  # it may have run in part: the writer fails, and the members are told
            self.fail(e)
            raise

    # ------------------------------------------------------------------ gathered rows
    def abort(self, reason: str, cause: Exception | None = None) -> None:
        """Abort the writer's fence's view (across nodes the node view, whose abort the view's parts
        pass to the view over nodes, which reaches the other nodes: :mod:`symmsync.spanning.parts`)."""
        self.fence.view.failure.abort_quietly(reason, cause=cause)

    def bytes_per_layer(self, rows: int) -> dict[str, int]:
        """What one layer moves per rank: cache bytes written, bytes sent to peers, and the part
        of those that crosses nodes (:meth:`symmsync.pcp.routes.Route.bytes_per_layer`).

        Raises:
            ConfigError: ``rows`` is not a non-negative int.
        """
        require(int_problem("rows", rows, minimum=0), rank=self.buffer.rank, call="DirectKVWriter.bytes_per_layer")
        return self._route.bytes_per_layer(rows, self.view.size)
