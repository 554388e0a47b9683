"""The kinds of memory a :class:`~symmsync.SymmetricBuffer` holds, and the steps that map them.

A buffer's memory is one of four kinds, chosen at construction, each one object::

    kind         the bytes are   the cells live           grow                  close releases
    Allocated    symmsync's      past the user region, a guard   (cannot grow)         every mapping
    Growable     symmsync's      past the reservation, a guard   commits, maps chunks  every mapping
    Adopted      the runtime's   apart, or at its tail, a gap    (cannot grow)         symmsync's cells only
    Registered   the runtime's   apart                           maps what it grew by  the peers' mappings, the cells

No store past a user region lands in a cell: the cells live in an allocation of their
own, or behind a guard (:data:`GUARD_BYTES` that nobody reads or writes), so a kernel
that overruns the user region by less than the slack and the guard can never make a
fence's wait pass. Only
``cells="tail"`` adoption, where the runtime gives symmsync the last bytes of its own
memory, keeps a plain gap (:data:`TAIL_GAP_BYTES`) between the two.

The pointer tables (:func:`address_table`) hold every mapping they name alive, as the
mappings' own tensors do: a table kept past ``close()`` never names unmapped memory.

Every step that maps memory on every rank is a step of one
:class:`~symmsync.agreement.Transaction`: all or nothing, the same
:class:`~symmsync.BackendError` on every rank when any rank fails, and what was mapped
undone. :func:`allocate`, :func:`reserve`, :func:`share_chunks` and :func:`share_local`
are those steps, in the order :mod:`symmsync.backends.base` gives for the backend's calls.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from . import backends
from .agreement import Transaction, agree, barrier
from .backends import Backend, LocalExport, Memory, Piece
from .cells import EPOCH, LINE, CellLayout, round_up
from .checks import int_problem, is_int, positive_int_problem
from .errors import BackendError, ConfigError

log = logging.getLogger("symmsync")

#: What a failed construction leaves, in its error.
RELEASED = "every rank released what it had mapped"

#: Bytes between the end of a user region (rounded up to them) and the cells of
#: memory symmsync maps: never read or written. They stay accessible (a tensor's storage
#: spans them, and torch.compile's functionalization reads whole storages: a
#: ``PROT_NONE`` guard made it fault), so they absorb a stray store instead of faulting.
GUARD_BYTES = 64 << 10
#: Bytes left unused between the user region and the cells of ``cells="tail"`` adoption
#: (fewer when the adopted memory is too small for them; the user region keeps a line).
TAIL_GAP_BYTES = 4096
#: The epoch ``close()`` leaves in every cell of this rank: past any count a peer can
#: publish, so a wait through arguments kept past ``close()`` never passes.
CLOSED_EPOCH = 1 << 62


def _drop(_owners: tuple[Any, ...]) -> None:
    """What a table's finalizer does: nothing, once it dropped its references."""


def keep_alive(table: torch.Tensor, *owners: Any) -> torch.Tensor:
    """Make ``table``'s storage hold ``owners`` (mapping tensors, records) alive; return it.

    The references go when the storage does, that is after the last tensor over it
    (``table``, a slice or a view of it: they share the storage). A copy (``clone()``,
    ``.to()``, indexing with a list, ``tolist()``) holds nothing.
    """
    weakref.finalize(table.untyped_storage(), _drop, owners).atexit = False
    return table


def address_table(shared: Shared, device: torch.device) -> torch.Tensor:
    """int64 tensor of every rank's base address in ``shared``, on ``device``, that holds
    each of those mappings alive for as long as it lives (:func:`keep_alive`)."""
    table = torch.tensor(shared.ptrs, dtype=torch.int64, device=device)
    return keep_alive(table, *[m.tensor for m in shared.peers])


class Shared:
    """One backend's memory of every rank, as mapped on this rank: its own, and each peer's."""

    def __init__(self, backend: Backend, world: int):
        self.backend = backend
        self.own: Memory | None = None
        self.peers: list[Memory | None] = [None] * world

    @property
    def ptrs(self) -> list[int]:
        """Every rank's base address, as mapped on this rank."""
        return [m.ptr for m in self.peers]

    def release(self) -> None:
        """Unmap the peers, release (or, not this rank's to free, only forget) this rank's memory. Idempotent."""
        be, own = self.backend, self.own
        for i, m in enumerate(self.peers):
            if m is not None and m is not own:
                self.peers[i] = None
                be.release(m)
        self.peers = [None] * len(self.peers)
        if own is not None and own.tensor is not None:
            be.release(own)
        self.own = None


def release(shared: list[Shared]) -> None:
    """Release each (the finalizer of a buffer nobody closed)."""
    for s in shared:
        s.release()


def args_problem(nbytes: Any, max_views: Any, channels: Any, max_nbytes: Any, options: Any) -> str | None:
    """What is wrong with the arguments every kind of memory is made from (the sizes, the
    backend's options), or ``None``; adopted and registered memory check the rest in their
    ``local_problem``."""
    problem = (
        positive_int_problem("nbytes", nbytes)
        or positive_int_problem("max_views", max_views)
        or positive_int_problem("channels", channels)
    )
    if problem is None and max_nbytes is not None:
        problem = int_problem("max_nbytes", max_nbytes, minimum=nbytes)
    if problem is None and not isinstance(options, (dict, type(None))):
        problem = f"backend_options must be a dict, got {options!r}"
    return problem


def create_backend(group: Any, name: str, dev: torch.device, options: dict[str, Any]) -> Backend:
    """The backend ``name`` on every rank, or :class:`~symmsync.BackendError` on every rank (collective)."""
    problem = None
    be = None
    try:
        be = backends.create(name, dev, **options)
    except (BackendError, ConfigError) as e:
        problem = str(e)
    except TypeError as e:  # an option the backend does not take
        problem = f"bad backend_options {options!r}: {e}"
    agree(group, "SymmetricBuffer", problem=problem, error=BackendError, failed=f"backend {name!r} unavailable on ")
    assert be is not None
    return be


# ---------------------------------------------------------------------- steps
def _abandon(be: Backend, handles: list[Any]) -> None:
    """Drop what the handles received name, which a dead peer can no longer drop itself."""
    for h in handles:
        if h is not None:
            be.abandon(h)


def _abandon_pieces(be: Backend, everyone: list[Any]) -> None:
    _abandon(be, [p.handle for pieces, _ in filter(None, everyone) for p in pieces])


def allocate(tx: Transaction, be: Backend, nbytes: int) -> Shared:
    """Allocate ``nbytes`` on every rank, exchange the handles, map every peer's."""
    rank, shared = dist.get_rank(tx.group), Shared(be, dist.get_world_size(tx.group))
    tx.on_failure(shared.release)

    def allocate_here() -> Any:
        shared.own = be.allocate(nbytes, rank)
        return be.export_handle(shared.own)

    received = tx.step("allocate on", allocate_here, undo=functools.partial(_abandon, be))
    be.exchanged(shared.own, received)  # who may map this rank's memory

    def map_peers() -> None:
        for r, h in enumerate(received):
            shared.peers[r] = shared.own if r == rank else be.import_handle(h, r)

    tx.step("map on", map_peers)
    # Every rank mapped every peer: names and exported handles can go, and once the
    # transaction's barrier passes they are gone on every rank (a crash leaks nothing).
    be.all_mapped(shared.own)
    return shared


def reserve(tx: Transaction, be: Backend, nbytes: int) -> Shared:
    """Reserve ``nbytes`` of address space for this rank's memory and every peer's."""
    rank, shared = dist.get_rank(tx.group), Shared(be, dist.get_world_size(tx.group))
    tx.on_failure(shared.release)

    def reserve_here() -> None:
        for r in range(len(shared.peers)):
            shared.peers[r] = be.reserve(nbytes, r)
        shared.own = shared.peers[rank]

    tx.step("reserve address space on", reserve_here)
    return shared


def share_chunks(tx: Transaction, shared: Shared, pieces: list[tuple[int, int]]) -> None:
    """Commit ``(offset, nbytes)`` pieces of this rank's reservation, map every peer's at the same offsets."""
    be, rank = shared.backend, dist.get_rank(tx.group)
    own = []

    def commit_here() -> tuple[list[Piece], int]:
        for off, n in pieces:
            c = be.commit(shared.own, off, n)
            tx.on_failure(functools.partial(be.unmap_chunk, shared.own, c))
            own.append(c)
        return [Piece(c.offset, c.handle) for c in own], os.getpid()

    received = tx.step("commit memory on", commit_here, undo=lambda everyone: _abandon_pieces(be, everyone))
    for c in own:
        be.chunk_exchanged(c, [pid for _, pid in received])  # who may ask for it

    def map_peers() -> None:
        for r, (theirs, _) in enumerate(received):
            if r != rank:
                peer = shared.peers[r]
                for off, h in theirs:
                    tx.on_failure(functools.partial(be.unmap_chunk, peer, be.map_chunk(peer, off, h)))

    tx.step("map on", map_peers)
    for c in own:
        be.chunk_all_mapped(c)


def share_local(tx: Transaction, shared: Shared, nbytes: int, known: int, max_nbytes: int) -> LocalExport:
    """Export this rank's registered memory in ``[0, nbytes)`` (the pieces wholly below
    ``known`` were exported before), map every peer's: at registration (``known`` 0) each
    peer's whole memory, at a grow the pieces it grew by. The caller forgets the export
    (:meth:`~symmsync.backends.Backend.forget_local`) once the transaction committed."""
    be, rank = shared.backend, dist.get_rank(tx.group)
    export: list[LocalExport] = []

    def export_here() -> tuple[list[Piece], int]:
        export.append(be.export_local(shared.own.ptr, nbytes, rank, known=known))
        tx.on_failure(functools.partial(be.forget_local, export[0]))
        return export[0].pieces, os.getpid()

    everyone = tx.step("share the registered memory of", export_here)
    be.local_exchanged(export[0], [pid for _, pid in everyone])

    def map_peers() -> None:
        for r, (theirs, _) in enumerate(everyone):
            if r == rank:
                continue
            if not known:
                shared.peers[r] = be.import_local(theirs, r, max_nbytes)
                continue
            peer = shared.peers[r]
            for c in be.extend_local(peer, theirs):
                tx.on_failure(functools.partial(be.unmap_chunk, peer, c))

    tx.step("map the registered memory of", map_peers)
    return export[0]


# ---------------------------------------------------------------------- kinds
class Kind:
    """What differs between the kinds of a buffer's memory (see the module's table).

    Attributes:
        data: the memory kernels address (:attr:`SymmetricBuffer.ptrs`).
        cells: symmsync's own allocation of cells, apart from ``data``; ``None``
            when the cells live in ``data``.
        layout: where the cells are, as offsets from the cells' base.
        max_nbytes: the most the user region can grow to; ``None`` when it cannot grow.
        registered: the memory is a runtime's, registered (:meth:`SymmetricBuffer.register`).
    """

    registered = False
    max_nbytes: int | None = None

    def __init__(self, data: Shared, layout: CellLayout, cells: Shared | None = None):
        self.data = data
        self.layout = layout
        self.cells = cells

    @property
    def _cell_home(self) -> Shared:
        return self.cells if self.cells is not None else self.data

    @property
    def capabilities(self) -> backends.Capabilities:
        return self._cell_home.backend.capabilities

    def shared(self) -> list[Shared]:
        """Everything close releases."""
        return [self.data] if self.cells is None else [self.data, self.cells]

    def cell_ptrs(self) -> list[int] | None:
        """The bases of the cells apart, or ``None`` when the cells are based at :attr:`data`'s."""
        return None if self.cells is None else self.cells.ptrs

    def local_memory(self, nbytes: int) -> torch.Tensor:
        """This rank's user region of ``nbytes`` (never the cells: they live apart)."""
        return self.data.own.tensor[:nbytes]

    def cell_memory(self) -> torch.Tensor:
        return self._cell_home.own.tensor

    def close_cells(self) -> None:
        """Set every epoch of this rank's cells to :data:`CLOSED_EPOCH` (``close()``).

        A wait of this rank then waits for a count no peer reaches, so a kernel launched
        after ``close()`` through kept arguments fails closed (times out, or sees an abort)
        instead of passing. Peers never read this rank's epochs. On a GPU the store is
        ordered on the current stream, after the work queued before ``close()``. Best
        effort: a CUDA context that a trap made unusable takes no store, and runs nothing.
        """
        sig = self.layout
        try:
            words = self.cell_memory()[sig.base : sig.base + sig.size].view(torch.int64)
            words[EPOCH // 8 :: sig.cell_bytes // 8].fill_(CLOSED_EPOCH)
        except Exception as e:  # noqa: BLE001 - close() must not raise for it
            log.warning("close(): could not mark this rank's cells closed: %s", e)

    def room(self, nbytes: int) -> int:
        """Bytes from this rank's base that a runtime's tensors may span (reserved ones included)."""
        return nbytes if self.max_nbytes is None else self.max_nbytes

    def grow(self, group: Any, nbytes_now: int, nbytes: int) -> None:
        """Map what ``nbytes`` needs past ``nbytes_now`` on every rank (collective); the
        caller checked the bounds on every rank."""
        raise AssertionError("grow() checks that the buffer can grow before it gets here")


class Allocated(Kind):
    """Memory symmsync allocated: the user region, a guard of :data:`GUARD_BYTES`, the cells.

    One allocation per rank, laid out ``[user | slack | guard | cells]``: the user region
    rounded up to a multiple of :data:`GUARD_BYTES` (the slack is mapped and unused), then
    the guard (mapped, never read or written), then the cells.
    """

    @classmethod
    def build(cls, group: Any, be: Backend, nbytes: int, max_views: int, channels: int) -> Allocated:
        start = round_up(nbytes, GUARD_BYTES)
        layout = CellLayout(start + GUARD_BYTES, dist.get_world_size(group), max_views, channels)
        with Transaction(group, "SymmetricBuffer", kept=RELEASED) as tx:
            data = allocate(tx, be, layout.base + layout.size)
        return cls(data, layout)


class Growable(Kind):
    """Memory symmsync allocated in address space reserved for ``max_nbytes``; the cells
    after that reservation's user part and a guard of :data:`GUARD_BYTES` of address space
    that is never mapped, so growing never moves them and no store past the user region
    reaches them."""

    def __init__(self, data: Shared, layout: CellLayout, max_nbytes: int, committed: int):
        super().__init__(data, layout)
        self.max_nbytes = max_nbytes
        self.committed = committed

    @classmethod
    def build(cls, group: Any, be: Backend, nbytes: int, max_nbytes: int, max_views: int, channels: int) -> Growable:
        g = be.granularity
        guard = round_up(GUARD_BYTES, g)
        layout = CellLayout(round_up(max_nbytes, g) + guard, dist.get_world_size(group), max_views, channels)
        total = layout.base + round_up(layout.size, g)
        with Transaction(group, "SymmetricBuffer", kept=RELEASED) as tx:
            data = reserve(tx, be, total)
            share_chunks(tx, data, [(layout.base, total - layout.base), (0, round_up(nbytes, g))])
        return cls(data, layout, max_nbytes, round_up(nbytes, g))

    def grow(self, group: Any, nbytes_now: int, nbytes: int) -> None:
        end = round_up(nbytes, self.data.backend.granularity)
        if end > self.committed:
            with Transaction(group, "SymmetricBuffer.grow", kept=f"the buffer keeps its {nbytes_now} bytes") as tx:
                share_chunks(tx, self.data, [(self.committed, end - self.committed)])
            self.committed = end


class Adopted(Kind):
    """Memory a runtime allocated and mapped on every rank; symmsync releases only its own cells."""

    @staticmethod
    def local_problem(
        ptrs: Any, nbytes: int, placement: Any, world: int, max_views: int, channels: int
    ) -> tuple[list[int], str | None]:
        """``(addresses, problem)`` of what :meth:`SymmetricBuffer.from_peer_addresses` was
        given (its sizes already checked): what keeps it from being adopted on this rank, or ``None``."""
        if placement not in ("separate", "tail"):
            return [], f"cells must be 'separate' or 'tail', got {placement!r}"
        try:
            ptrs = [operator.index(p) for p in ptrs]
        except TypeError:
            return [], "ptrs must be a sequence of int addresses"
        if any(not 0 < p < 2**64 for p in ptrs):
            return ptrs, f"ptrs holds {[p for p in ptrs if not 0 < p < 2**64]}, which are not addresses"
        if len(ptrs) != world:
            return ptrs, f"ptrs holds {len(ptrs)} addresses for a group of {world} ranks"
        cells = CellLayout(0, world, max_views, channels).size
        if placement == "tail" and nbytes < cells + LINE:
            return ptrs, f"{nbytes} bytes cannot hold symmsync's {cells} bytes of cells; adopt a larger region"
        return ptrs, None

    @classmethod
    def build(
        cls,
        group: Any,
        dev: torch.device,
        ptrs: list[int],
        nbytes: int,
        placement: str,
        max_views: int,
        channels: int,
        options: dict[str, Any],
    ) -> tuple[Adopted, int]:
        """The adopted memory and its user region's size (``nbytes`` less the cells at its tail)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        be = backends.adopted(dev)
        data = Shared(be, world)
        for r, p in enumerate(ptrs):
            data.peers[r] = be.import_handle(backends.Address(p, nbytes), r)
        data.own = data.peers[rank]
        if placement == "tail":
            probe = CellLayout(0, world, max_views, channels)
            base = (nbytes - probe.size) // LINE * LINE
            layout = CellLayout(base, world, max_views, channels)
            data.own.tensor[base : base + layout.size].zero_()
            if be.capabilities.streams:
                torch.cuda.synchronize(dev)
            barrier(group)  # no rank fences before every rank's cells are zero
            # A gap between the user region and the cells: a short overrun of the user
            # region lands in bytes nobody reads (the runtime's memory cannot be protected).
            return cls(data, layout), max(LINE, base - TAIL_GAP_BYTES)
        layout = CellLayout(0, world, max_views, channels)
        cells_be = create_backend(group, backends.name_for(dev), dev, dict(options))
        with Transaction(group, "SymmetricBuffer.from_peer_addresses", kept=RELEASED) as tx:
            cells = allocate(tx, cells_be, layout.size)
        return cls(data, layout, cells), nbytes


class Registered(Kind):
    """Memory a runtime owns and may grow in address space it reserved; the cells apart."""

    registered = True

    def __init__(self, data: Shared, layout: CellLayout, cells: Shared, max_nbytes: int, nbytes: int, end: int):
        super().__init__(data, layout, cells)
        self.max_nbytes = max_nbytes
        self.committed = nbytes
        self.end = end  #: where the pieces peers mapped end, from the registered address

    @staticmethod
    def local_problem(local: Any, nbytes: Any, device: Any, align: int) -> tuple[int, torch.device | None, str | None]:
        """``(address, device, problem)`` of the memory passed to :meth:`SymmetricBuffer.register`:
        what keeps it from being registered on this rank, or ``None``."""
        ptr, dev, problem = _local_address(local, nbytes, device)
        if problem is None and ptr % align:
            problem = f"the memory starts at {ptr:#x}, not on a multiple of {align} bytes (kernels store 16 at a time)"
        elif problem is None:
            try:
                backends.resolve(backends.name_for(dev), dev)  # e.g. CPU memory needs the interpreter
            except ConfigError as e:
                problem = str(e)
        return ptr, dev, problem

    @classmethod
    def build(
        cls,
        group: Any,
        be: Backend,
        cells_be: Backend,
        ptr: int,
        nbytes: int,
        max_nbytes: int,
        max_views: int,
        channels: int,
    ) -> Registered:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        layout = CellLayout(0, world, max_views, channels)
        with Transaction(group, "SymmetricBuffer.register", kept="nothing stays mapped") as tx:
            cells = allocate(tx, cells_be, layout.size)
            data = Shared(be, world)
            tx.on_failure(data.release)
            data.own = data.peers[rank] = Memory(ptr, max_nbytes, backends.tensor_at(ptr, max_nbytes, be.device), rank)
            export = share_local(tx, data, nbytes, 0, max_nbytes)
        be.forget_local(export)  # every peer mapped: what only served the exchange can go
        return cls(data, layout, cells, max_nbytes, nbytes, export.end)

    def grow(self, group: Any, nbytes_now: int, nbytes: int) -> None:
        if nbytes > self.committed:
            with Transaction(group, "SymmetricBuffer.grow", kept=f"the buffer keeps its {nbytes_now} bytes") as tx:
                export = share_local(tx, self.data, nbytes, self.end, self.max_nbytes)
            self.end = export.end
            self.data.backend.forget_local(export)
            self.committed = nbytes


def _local_address(local: Any, nbytes: Any, device: Any) -> tuple[int, torch.device | None, str | None]:
    """``(address, device, problem)`` of a tensor or an int address with ``nbytes``."""
    if isinstance(local, torch.Tensor):
        if not local.is_contiguous():
            return 0, None, "local must be a contiguous tensor (its bytes from data_ptr() on)"
        if not (local.is_cuda or local.is_cpu):
            return 0, None, f"local is on {local.device}, which has no memory to register"
        if nbytes is not None and is_int(nbytes) and nbytes > local.numel() * local.element_size():
            return 0, None, f"nbytes={nbytes} is more than the tensor's {local.numel() * local.element_size()} bytes"
        return local.data_ptr(), local.device, None
    if not is_int(local) or not 0 < local < 2**64:
        return 0, None, f"local must be a tensor or an int address, got {local!r}"
    if nbytes is None:
        return 0, None, "an address needs nbytes"
    try:
        dev = backends.as_device(device) if device is not None else backends.default_device()
    except ConfigError as e:
        return 0, None, str(e)
    return local, dev, None
