"""SymmetricBuffer: one collective allocation with direct access to every peer's copy.

Every rank of a torch.distributed group allocates the same number of bytes; the
handles are exchanged through the group and every rank maps every peer of its node
(:mod:`symmsync.core.nodes`; on one host, every peer), so a kernel on any rank can load from
and store to those ranks' memory through a table of base addresses (:attr:`SymmetricBuffer.ptrs`).

Each rank has two allocations, each mapped (on this rank, and on every peer) between
guards of address space that is never mapped (``memory.GUARD_BYTES``, 2 MiB)::

    [guard | user region: [0, nbytes), what tensor() and kernels address | guard]
    [guard | cells of the peer views' fences (see core/views.py)                | guard]

so user offsets are the same on every rank, and a kernel that stores past the user
region faults at the guard (the host backend: the process dies of SIGSEGV; a GPU: the
kernel traps) before it could reach a cell. Kernels address the user region through
:attr:`SymmetricBuffer.ptrs` and the cells through :attr:`SymmetricBuffer.cell_ptrs`.
A growable buffer (``max_nbytes``) reserves address space for ``max_nbytes`` between
the guards and commits it as it grows. Memory a runtime adopts or registers
(:meth:`SymmetricBuffer.register`) holds only the runtime's bytes; the cells live in
symmsync's own guarded allocation as for every kind. Each of these kinds of memory is
one object of :mod:`symmsync.core.memory`, which also holds the collective steps that map them.

The pointer tables (:attr:`~SymmetricBuffer.ptrs`, :attr:`~SymmetricBuffer.cell_ptrs`,
a view's) hold the mappings they name alive, as tensors from
:meth:`~SymmetricBuffer.tensor` do: one kept past :meth:`~SymmetricBuffer.close` never
names unmapped memory (see :meth:`~SymmetricBuffer.close`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import backends
from ..checks import byte_span, check_index, int_problem, is_int, require
from ..errors import CLOSED_REASON, BoundsError, ClosedError, ConfigError, SizeMismatchError
from ..language.cells import CellLayout
from . import adoption, liveness, memory, nodes
from .agreement import Same, agree
from .regions import Region, Regions
from .views import PeerView, create_view

ALIGN = memory.ALIGN  #: every tensor view starts on a multiple of this many bytes

__all__ = ["ALIGN", "CellLayout", "SymmetricBuffer"]

#: How the ranks compare a buffer's arguments, in this order: sizes that differ are a SizeMismatchError.
_AGREED = dict.fromkeys(("backend", "cells", "max_views", "channels"), Same()) | dict.fromkeys(
    ("nbytes", "max_nbytes"),
    Same(SizeMismatchError, "every rank must map the same size: compute it from values that agree across ranks"),
)


class SymmetricBuffer:
    """A collective allocation of ``nbytes`` on every rank, with every peer mapped.

    Args:
        nbytes: bytes of the user region on each rank; the same on every rank.
        group: torch.distributed process group (default: the world group). It must be
            initialized; every rank of it must construct the buffer.
        device: where the memory lives (default: the current CUDA device if there is
            one, else the CPU).
        backend: ``"auto"`` (CUDA for CUDA devices, host otherwise; with no ``device``,
            host when Triton's interpreter is active in this process, as in
            ``symmsync.testing.run(backend="host")``, else the current CUDA device if
            there is one), ``"host"`` or ``"cuda"``.
        max_views: peer views that can be created on this buffer (each owns a cell region).
        channels: fence channels per view.
        max_nbytes: make the buffer growable up to this many bytes (:meth:`grow`):
            address space for it is reserved on every rank, for this rank's memory and
            for every peer's, so addresses never move. Default: not growable.
        backend_options: passed to the backend (the CUDA backend takes ``handle_type``).

    Raises:
        ConfigError: a bad argument on any rank (raised on every rank).
        CaptureError: a rank's current stream was capturing a CUDA graph (raised on every
            rank, before any device work: create buffers before capture).
        SizeMismatchError: ranks asked for different sizes (raised on every rank).
        BackendError: a rank could not allocate or map (raised on every rank; nothing
            stays mapped).

    Example::

        with ss.SymmetricBuffer(1 << 20) as buf:
            peer = buf.tensor(0, (256,), torch.float32, rank=(buf.rank + 1) % buf.world_size)
    """

    def __init__(
        self,
        nbytes: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        backend: str = "auto",
        *,
        max_views: int = 16,
        channels: int = 4,
        max_nbytes: int | None = None,
        backend_options: dict[str, Any] | None = None,
    ):
        backends.refuse_compiling("SymmetricBuffer")
        self._join(group)
        problem = None
        try:
            name, dev = backends.resolve(backend, device)
        except ConfigError as e:
            name, dev, problem = backend, None, str(e)
        problem = problem or memory.args_problem(nbytes, max_views, channels, max_nbytes, backend_options)
        sizes = {"nbytes": nbytes, "max_nbytes": max_nbytes, "max_views": max_views, "channels": channels}
        self._agree("SymmetricBuffer", dev, problem, {"backend": name, **sizes}, new=True)

        self._nbytes = nbytes
        self._device = dev
        be = memory.create_backend(self._group, name, dev, backend_options or {})
        if max_nbytes is None:
            self._finish(memory.Allocated.build(self._group, be, self._near, nbytes, max_views, channels))
        else:
            self._finish(memory.Growable.build(self._group, be, self._near, nbytes, max_nbytes, max_views, channels))

    def _join(self, group: dist.ProcessGroup | None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "SymmetricBuffer is a collective: call torch.distributed.init_process_group first "
                "(symmsync.testing.run does it for tests)"
            )
        self._group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        self._closed = False
        # Every live PeerView created on it: close() aborts them. Weak, so that a buffer
        # and its views form no reference cycle (which kept process groups alive at exit).
        self._views: weakref.WeakSet[PeerView] = weakref.WeakSet()
        self._regions = Regions()  # who owns which bytes of the user region (core/regions.py)
        self._claims: dict[Region, int] = {}  # the users' named regions: claim(), release()

    def _finish(self, kind: memory.Kind) -> None:
        self._memory = kind
        self._cells = kind.layout
        # Tables that hold what they name: a kernel launched through one kept past close()
        # still finds every mapping (memory.address_table).
        self._ptrs: torch.Tensor | None = memory.address_table(kind.data, self._device)
        self._cell_ptrs = memory.address_table(kind.cells, self._device)
        self._finalizer = weakref.finalize(self, kind.release)

    # ---------------------------------------------------------------- adoption
    @classmethod
    def from_peer_addresses(
        cls,
        ptrs: Sequence[int],
        nbytes: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        *,
        cells: str = "separate",
        max_views: int = 16,
        channels: int = 4,
        backend_options: dict[str, Any] | None = None,
    ) -> SymmetricBuffer:
        """Adopt symmetric memory a runtime already allocated and mapped (collective).

        Args:
            ptrs: ``ptrs[r]`` is the address, usable on this rank's device, of rank
                ``r``'s memory (``r`` in the group's order).
            nbytes: size of each rank's memory (the same on every rank).
            group: the process group of those ranks (default: the world group).
            device: where the memory is (default: the current CUDA device, else CPU).
            cells: where symmsync keeps its fence cells: ``"separate"`` (the default, and
                the only placement), in an allocation of its own between guards, so every
                adopted byte stays the runtime's (:attr:`nbytes` is ``nbytes``; kernels
                address the cells through :attr:`cell_ptrs`) and no store past the
                adopted memory reaches a cell. ``"tail"`` (the cells in the last adopted
                bytes) is refused: drop the argument.
            backend_options: for the cells' own allocation: passed to its backend, e.g.
                ``{"handle_type": "cuda_ipc"}`` where shareable handles are unavailable
                (that memory has no guards).

        The runtime keeps ownership: :meth:`close` releases nothing it adopted.

        Raises (on every rank): ConfigError, SizeMismatchError for bad or differing
        arguments (``cells="tail"`` too); CaptureError during CUDA graph capture; BackendError.
        """
        call = "SymmetricBuffer.from_peer_addresses"
        return adoption.adopt(cls, ptrs, nbytes, group, device, cells, max_views, channels, backend_options, call)

    @classmethod
    def from_torch(cls, handle: Any, group: dist.ProcessGroup | None = None, **kwargs: Any) -> SymmetricBuffer:
        """Adopt a ``torch.distributed._symmetric_memory`` rendezvous handle (collective).

        Uses the handle's buffer (``buffer_ptrs``, ``buffer_size``); torch's own signal
        pads stay torch's. See :meth:`from_peer_addresses` for where symmsync keeps its
        cells, its keyword arguments and its errors.
        """
        device, call = torch.device("cuda", torch.cuda.current_device()), "SymmetricBuffer.from_torch"
        options = {"cells": "separate", "max_views": 16, "channels": 4, "backend_options": None, **kwargs}
        unknown = sorted(set(options) - {"cells", "max_views", "channels", "backend_options"})
        if unknown:
            raise TypeError(f"SymmetricBuffer.from_torch() got unexpected keyword arguments {unknown}")
        rest = [options[k] for k in ("cells", "max_views", "channels", "backend_options")]
        return adoption.adopt(cls, list(handle.buffer_ptrs), int(handle.buffer_size), group, device, *rest, call)

    @classmethod
    def register(
        cls,
        local: torch.Tensor | int,
        nbytes: int | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        max_nbytes: int | None = None,
        device: torch.device | str | None = None,
        max_views: int = 16,
        channels: int = 4,
        backend_options: dict[str, Any] | None = None,
    ) -> SymmetricBuffer:
        """Make memory a runtime owns symmetric: map every peer's (collective).

        Args:
            local: this rank's memory, made by the runtime's own allocator: a tensor
                (its bytes from ``local.data_ptr()``), or an int address with ``nbytes``.
            nbytes: bytes to register (default: the tensor's); the same on every rank.
            group: the process group (default: the world group).
            max_nbytes: the most the runtime's memory may grow to (default:
                ``nbytes``): peers reserve address space for it, and :meth:`grow`
                maps what the owner committed since.
            device: where ``local`` is, for an int address (default: the current CUDA
                device, else the CPU).
            backend_options: passed to the backend (CUDA: ``handle_type``).

        Offsets (:meth:`tensor`, the pointer table) count from ``local``, so a runtime
        finds its tensors at the offsets it already knows; :meth:`offset_of` gives them.
        symmsync writes none of the runtime's bytes: its cells live in a small
        allocation of its own (:attr:`cell_ptrs`). The runtime keeps ownership:
        :meth:`close` unmaps the peers' memory here and releases nothing the runtime
        owns; close on every rank (and synchronize) before the runtime frees it
        (docs/runtime-memory.md says why and what happens otherwise).

        What memory can be registered, and how each kind is shared: docs/runtime-memory.md.

        Raises:
            BackendError: on every rank, when any rank's memory cannot be shared or mapped.
            ConfigError, SizeMismatchError: on every rank, for bad or differing arguments.
            CaptureError: on every rank, when a rank's current stream was capturing a CUDA graph.
        """
        return adoption.register(cls, local, nbytes, group, max_nbytes, device, max_views, channels, backend_options)

    # ---------------------------------------------------------------- construction
    def _agree(
        self, call: str, dev: Any, problem: str | None, args: dict, error: type = ConfigError, *, new: bool = False
    ) -> None:
        """Agree on ``args`` (:data:`_AGREED` says how each compares): every rank raises the same error (a capture
        on ``dev``, a problem, ranks that differ), or none does; ``new``: also on the nodes
        (:mod:`symmsync.core.nodes`)."""
        if new:
            args, problem = nodes.with_fields(args, problem, dev)
            args["process"] = liveness.identity()  # what the node peers watch (core/liveness.py)
        same = {k: rule for k, rule in (_AGREED | nodes.AGREED).items() if k in args}
        agreed = agree(self._group, call, args, problem=problem, error=error, same=same, device=dev)
        if new:  # and what this rank maps: its node's ranks
            self._nodes, self._key, self._near = nodes.layout(agreed, call, self._rank)
            self._processes = tuple(a["process"] for a in agreed)

    def grow(self, nbytes: int) -> None:
        """Grow the user region to ``nbytes`` on every rank (collective).

        Commits the new memory (or, for registered memory, takes what the runtime
        committed since) and maps every peer's inside the address space reserved at
        construction. :attr:`ptrs`, and every tensor, view, fence and writer made
        earlier stay valid; a CUDA graph captured before the grow replays unchanged.
        Growing to the current size does nothing; shrinking is refused.

        Raises (on every rank; when several ranks are refused, the error of the first):
            ClosedError: a rank closed its buffer.
            CaptureError: a rank's current stream was capturing a CUDA graph (no commit
                during capture: grow before capturing, or between replays).
            BoundsError: ``nbytes`` is past ``max_nbytes``, or below the current size.
            SizeMismatchError: ranks asked for different sizes.
            BackendError: a rank could not commit or map; every rank then unmaps what
                this grow mapped, and the buffer keeps its size.
        """
        backends.refuse_compiling("SymmetricBuffer.grow")
        problem, error = int_problem("nbytes", nbytes, minimum=1), ConfigError
        if self._closed:  # still enter the exchange: every rank raises, none waits
            problem, error = "used after close() on this rank", ClosedError
        elif problem is None and self.max_nbytes is None:
            problem = "the buffer is not growable: create it with max_nbytes="
        elif problem is None and not self._nbytes <= nbytes <= self.max_nbytes:
            problem = f"nbytes={nbytes} is outside [{self._nbytes}, {self.max_nbytes}] (the size now, max_nbytes)"
            error = BoundsError
        self._agree("SymmetricBuffer.grow", self._device, problem, {"nbytes": nbytes}, error)
        self._memory.grow(self._group, self._nbytes, nbytes)
        self._nbytes = nbytes

    # ---------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        """This process's rank in the buffer's group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the buffer's group."""
        return self._world

    @property
    def nbytes(self) -> int:
        """Bytes of the user region on each rank (what :meth:`grow` changes)."""
        return self._nbytes

    @property
    def max_nbytes(self) -> int | None:
        """The most :meth:`grow` can reach, or ``None`` for a buffer that cannot grow."""
        return self._memory.max_nbytes

    @property
    def registered(self) -> bool:
        """True for memory a runtime owns (:meth:`register`)."""
        return self._memory.registered

    @property
    def device(self) -> torch.device:
        """Device holding this rank's memory (and the pointer tables)."""
        return self._device

    @property
    def backend(self) -> str:
        """Name of the memory backend in use: ``"host"`` or ``"cuda"``."""
        return self._memory.data.backend.name

    @property
    def capabilities(self) -> backends.Capabilities:
        """What kernels over this memory do (traps, streams, ...): ask this, never :attr:`backend`."""
        return self._memory.capabilities

    @property
    def nodes(self) -> nodes.NodeLayout:
        """The group's ranks split into nodes (agreed): only this rank's node is mapped (:mod:`symmsync.core.nodes`)."""
        return self._nodes

    @property
    def group(self) -> dist.ProcessGroup:
        """The torch.distributed group the buffer was allocated over."""
        return self._group

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or a failed construction released everything)."""
        return self._closed

    @property
    def ptrs(self) -> torch.Tensor:
        """int64 tensor ``[world_size]`` of every rank's base address, on :attr:`device`.

        The same tensor for the buffer's life. It holds every mapping it names alive: a
        table (or a slice or view of it) kept past :meth:`close` still names mapped
        memory (see :meth:`close`); a copy (``tolist()``, ``clone()``) holds nothing. Refused
        (:class:`~symmsync.ViewError`) over several nodes: kernels take a node's view's tables.
        """
        self._check_open("ptrs")
        nodes.refuse_table(self._nodes, "ptrs", f"rank {self._rank}: SymmetricBuffer")
        return self._ptrs

    @property
    def cell_ptrs(self) -> torch.Tensor:
        """int64 tensor ``[world_size]``: the base each rank's cells are offset from.

        The bases of symmsync's own cell allocations, apart from the user regions of
        :attr:`ptrs` for every kind of memory (each between guards: no store past a user
        region reaches a cell). Kernels pass it, never :attr:`ptrs`, to the fence
        primitives. Like :attr:`ptrs`, it holds the mappings it names alive.
        """
        self._check_open("cell_ptrs")
        nodes.refuse_table(self._nodes, "cell_ptrs", f"rank {self._rank}: SymmetricBuffer")
        return self._cell_ptrs

    @property
    def cells(self) -> CellLayout:
        """Where fences' cells live, as offsets from :attr:`cell_ptrs`."""
        return self._cells

    @property
    def regions(self) -> Regions:
        """The claims on this rank's user region (:mod:`symmsync.core.regions`): iterate it for the
        :class:`~symmsync.core.regions.Region` each owner holds. Consumers claim their bytes
        when they are made; :meth:`claim` is a user's."""
        return self._regions

    @property
    def views(self) -> tuple[PeerView, ...]:
        """This rank's live views of the buffer (what :meth:`close` aborts)."""
        return tuple(self._views)

    # ---------------------------------------------------------------- access
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"rank {self._rank}: SymmetricBuffer.{what} used after close()")

    def local_memory(self) -> torch.Tensor:
        """``uint8`` tensor over this rank's user region (:attr:`nbytes` bytes).

        The cells are never part of it: they live apart (:meth:`cell_memory`).
        """
        self._check_open("local_memory")
        return self._memory.user_tensor(self._rank)[: self._nbytes]

    def cell_memory(self, rank: int | None = None) -> torch.Tensor:
        """``uint8`` tensor over this rank's cells, from its :attr:`cell_ptrs` base, or over the
        cells of ``rank`` as this rank maps them (a member of its node).

        Cell ``c`` is at ``[c, c + cell_bytes)``.

        Raises:
            BoundsError: ``rank`` is not a rank of the group.
            ViewError: ``rank`` is on another node, whose cells are not mapped here.
        """
        self._check_open("cell_memory")
        if rank is None or rank == self._rank:
            return self._memory.cell_memory()
        me, call = self._rank, "SymmetricBuffer.cell_memory"
        rank = check_index("rank", rank, self._world, "the group", rank=me, call=call)
        nodes.refuse_peer(self._nodes, me, rank, call)
        return self._memory.cells.peers[rank].tensor

    def offset_of(self, t: torch.Tensor) -> int:
        """Byte offset of ``t``'s first element from this rank's base address.

        ``t`` may reach into address space reserved for growth (``max_nbytes``), as a
        runtime's tensors over a growable cache do; only :attr:`nbytes` of it can be
        used until :meth:`grow` maps more.

        Raises:
            BoundsError: ``t`` does not lie inside this rank's (reserved) user region.
        """
        self._check_open("offset_of")
        call = "SymmetricBuffer.offset_of"
        if not isinstance(t, torch.Tensor):
            require(f"expected a tensor, got {type(t).__name__}", rank=self._rank, call=call)
        base, room = self._memory.data.own.ptr, self._memory.room(self._nbytes)
        off = t.data_ptr() - base
        span = byte_span(t)
        if t.device != self._device or off < 0 or off + span > room:
            require(
                f"the tensor at {t.data_ptr():#x} ({span} bytes on {t.device}) is not inside this rank's "
                f"{room} bytes at {base:#x} on {self._device}",
                rank=self._rank,
                call=call,
                error=BoundsError,
            )
        return off

    def tensor(
        self, offset: int, shape: Sequence[int] | int, dtype: torch.dtype, rank: int | None = None
    ) -> torch.Tensor:
        """A tensor over ``rank``'s memory (default: this rank's), without a copy.

        Args:
            offset: byte offset into the user region; a multiple of 16.
            shape: shape of the view.
            dtype: element type.
            rank: whose memory to view, as a rank of the buffer's group.

        Raises:
            BoundsError: the view would leave the user region or is misaligned, or
                ``rank`` is not a rank of the group.
            ViewError: ``rank`` is on another node (:attr:`nodes`), whose memory is not mapped here.
            ConfigError: an argument of the wrong type.
            ClosedError: the buffer is closed.
        """
        self._check_open("tensor")
        call = "SymmetricBuffer.tensor"
        me = self._rank
        rank = me if rank is None else check_index("rank", rank, self._world, "the group", rank=me, call=call)
        if not isinstance(dtype, torch.dtype):
            require(f"dtype must be a torch.dtype, got {dtype!r}", rank=me, call=call)
        try:
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
        except TypeError:
            shape = (shape,)  # not a sequence: rejected below
        if any(not is_int(s) or s < 0 for s in shape):
            require(f"shape must hold non-negative ints, got {shape}", rank=me, call=call)
        require(int_problem("offset", offset, minimum=0), rank=me, call=call)
        require(int_problem("offset", offset, multiple_of=ALIGN), rank=me, call=call, error=BoundsError)
        size = math.prod(shape) * dtype.itemsize
        if offset + size > self._nbytes:
            require(
                f"a {tuple(shape)} {dtype} view at offset {offset} needs bytes [{offset}, {offset + size}) "
                f"but the buffer holds {self._nbytes}",
                rank=me,
                call=call,
                error=BoundsError,
            )
        nodes.refuse_peer(self._nodes, me, rank, call)
        return self._memory.user_tensor(rank)[offset : offset + size].view(dtype).view(shape)

    def claim(self, name: str, offset: int, nbytes: int) -> Region:
        """Claim bytes ``[offset, offset + nbytes)`` of the user region as ``name``'s (collective).

        The bytes are then this name's until :meth:`release`: a consumer made over them
        later (a collective's workspace, the writer's caches) or another claim is refused
        on every rank, naming both owners and ranges; a claim over a consumer's bytes is
        refused the same way. Claiming checks ownership only: :meth:`tensor` reads and
        writes any bytes. Take offsets from :func:`symmsync.carve`.

        Raises (on every rank, when any rank's claim is refused):
            ConfigError: ``name`` is not a non-empty str, a size is not a positive int, the
                range overlaps another owner's, or the ranks' arguments differ.
            BoundsError: the range is past :attr:`nbytes`.
            ClosedError: a rank closed its buffer.
            CaptureError: a rank's current stream was capturing a CUDA graph.
        """
        call = "SymmetricBuffer.claim"
        backends.refuse_compiling(call)
        problem, error = None, ConfigError
        if self._closed:
            problem, error = "used after close() on this rank", ClosedError
        elif not isinstance(name, str) or not name:
            problem = f"name must be a non-empty str, got {name!r}"
        else:
            problem = int_problem("offset", offset, minimum=0) or int_problem("nbytes", nbytes, minimum=1)
        if problem is None and offset + nbytes > self._nbytes:
            problem = f"bytes [{offset}, {offset + nbytes}) are past the buffer's {self._nbytes}"
            error = BoundsError
        region = Region(f"the region {name!r}", offset, offset + nbytes) if problem is None else None
        problem = problem or self._regions.problem(region)
        same = dict.fromkeys(("name", "offset", "nbytes"), Same())
        args = {"name": name, "offset": offset, "nbytes": nbytes}
        agree(self._group, call, args, problem=problem, error=error, same=same, device=self._device)
        self._claims[region] = self._regions.claim(region)
        return region

    def release(self, region: Region) -> None:
        """Give back a region :meth:`claim` returned (this rank's claim; idempotent). Release on
        every rank: a claim that some ranks hold refuses, on every rank, what overlaps it."""
        key = self._claims.pop(region, None)
        if key is not None:
            self._regions.release(key)

    # ---------------------------------------------------------------- views
    def view(self, ranks: Sequence[int]) -> PeerView:
        """This rank's :class:`~symmsync.PeerView` over ``ranks`` (which must include it).

        A collective over the buffer's group: every rank calls it, each with the rank
        list of its own subgroup, in the same order on every member. Subgroups may be
        disjoint (TP×PCP) or nested; each view gets its own cell region. The same as
        :func:`symmsync.core.views.create_view`, where views are made.
        """
        self._check_open("view")
        view = create_view(self, ranks)  # raises CaptureError on every rank during capture
        self._views.add(view)  # close() aborts every view of the buffer
        return view

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release this rank's memory and its peer mappings. Idempotent; needs no other rank.

        Every view of the buffer is aborted first, with the reason "closed": members still
        waiting in a fence on one of them raise :class:`~symmsync.PeerAborted` at once instead
        of waiting out their budget; a fence they already completed is not affected. The buffer
        raises :class:`~symmsync.ClosedError` from then on; symmsync's own objects drop their
        references to its mappings.

        A tensor from :meth:`tensor` (or :meth:`local_memory`), a pointer table (:attr:`ptrs`,
        :attr:`cell_ptrs`, a view's) or a fence's ``kernel_args`` taken before closing stays
        safe: it keeps the mappings it names alive (a peer's memory then shows what that peer
        last wrote), and a fence wait through kept arguments fails at its first poll, whatever
        the slots hold (docs/runtime-memory.md, "Tables and tensors kept past close").
        Registered or adopted memory is the runtime's: its mappings of the peers go, its own
        bytes are never released.
        """
        if self._closed:
            return
        for view in list(self._views):  # peers still fencing with this rank fail at once, told "closed"
            view.failure.abort_quietly(CLOSED_REASON)
        self._closed = True
        self._finalizer.detach()
        if not backends.capturing(self._device):  # a store during capture would join the user's graph
            self._memory.close_cells()
        for view in list(self._views):
            view.release_tables()  # and its fences': only what users kept holds the mappings now
        self._ptrs = self._cell_ptrs = None
        self._memory.release()

    def __enter__(self) -> SymmetricBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._nbytes} bytes"
        if self.max_nbytes is not None and not self._closed:
            state += f" of {self.max_nbytes}"
        kind = ", registered" if self.registered else ""
        return (
            f"SymmetricBuffer(rank={self._rank}/{self._world}, {state}, backend={self.backend}{kind}, "
            f"device={self._device})"
        )
