"""The kinds of memory a :class:`~symmsync.SymmetricBuffer` holds, and the steps that map them.

A buffer's memory is one of four kinds, chosen at construction, each one object::

    kind         the bytes are   grow                  close releases
    Allocated    symmsync's      (cannot grow)         every mapping
    Growable     symmsync's      commits, maps chunks  every mapping
    Adopted      the runtime's   (cannot grow)         symmsync's cells only
    Registered   the runtime's   maps what it grew by  the peers' mappings, the cells

No store through a user region's address reaches a cell. The cells of every kind live in
an allocation of their own (:func:`guarded`), addressed through their own table
(:attr:`SymmetricBuffer.cell_ptrs`), and every mapping symmsync makes, of this rank's
memory and of each peer's, lies between two guards of :data:`GUARD_BYTES` of address
space that is reserved and never mapped::

    [guard | user region (mapped: rounded up to the backend's granularity) | guard]
    [guard | cells | guard]

So a store that runs past the user region (or past any other mapping of the process)
faults at the first byte of a guard before it could reach a cell: on the host backend
the writing process dies of ``SIGSEGV``, on a GPU its kernel traps with an illegal
address. No tensor's storage spans a guard or the cells (torch.compile's
functionalization reads whole storages): each mapping's tensor covers only its own bytes
(:func:`reserve`). A store at an arbitrary address, or one that jumps further than a
guard, is not covered. Memory of the CUDA backend's ``handle_type="cuda_ipc"`` has no
guards (the driver places those allocations); its cells still live apart.

The pointer tables (:func:`address_table`) hold every mapping they name alive, as the
mappings' own tensors do: a table kept past ``close()`` never names unmapped memory.

Over a group that spans several nodes (:mod:`symmsync.core.nodes`) each rank maps the peers of
its own node only (:attr:`Shared.near`): no address space is reserved for, and no handle
imported from, a rank of another node, and that rank's table entry is 0 (the buffer and
its views refuse to hand such a table to a kernel). Memory a runtime adopted
(:class:`Adopted`) is refused over several nodes: its addresses of other nodes' ranks
cannot be mapped here; registered and growable memory map and grow the near peers only.

Every step that maps memory on every rank is a step of one
:class:`~symmsync.core.agreement.Transaction`: all or nothing, the same
:class:`~symmsync.BackendError` on every rank when any rank fails, and what was mapped
undone. :func:`reserve`, :func:`share_chunks` (the two make :func:`guarded`),
:func:`allocate` and :func:`share_local` are those steps, in the order
:mod:`symmsync.backends.base` gives for the backend's calls.
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

from .. import backends
from ..backends import Backend, LocalExport, Memory, Piece
from ..checks import int_problem, is_int, positive_int_problem
from ..errors import BackendError, ConfigError
from ..language.cells import CLOSED_EPOCH, EPOCH, CellLayout, round_up
from .agreement import Transaction, agree

log = logging.getLogger("symmsync")

#: What a failed construction leaves, in its error.
RELEASED = "every rank released what it had mapped"

ALIGN = 16
"""Every tensor view of a buffer starts on a multiple of this many bytes (a registered tensor too)."""

#: Bytes of address space reserved and never mapped before and after every mapping
#: symmsync makes (rounded up to the backend's granularity): a store that runs into
#: them faults. 2 MiB, the CUDA backend's granularity: a whole unit of its address space.
GUARD_BYTES = 2 << 20


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
    return keep_alive(table, *[m.tensor for m in shared.peers if m is not None])


class Shared:
    """One backend's memory of every rank, as mapped on this rank: its own, and each near peer's.

    Attributes:
        near: the ranks mapped here (this rank's node, itself included); the others stay ``None``.
    """

    def __init__(self, backend: Backend, world: int, near: tuple[int, ...] | None = None):
        self.backend = backend
        self.own: Memory | None = None
        self.peers: list[Memory | None] = [None] * world
        self.near = tuple(range(world)) if near is None else near

    @property
    def ptrs(self) -> list[int]:
        """Every rank's base address, as mapped on this rank; 0 for a rank of another node."""
        return [0 if m is None else m.ptr for m in self.peers]

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


def allocate(tx: Transaction, be: Backend, near: tuple[int, ...], nbytes: int) -> Shared:
    """Allocate ``nbytes`` on every rank, exchange the handles, map every ``near`` peer's: for a
    backend that cannot reserve address space (:func:`guarded` says when), so without guards."""
    rank, shared = dist.get_rank(tx.group), Shared(be, dist.get_world_size(tx.group), near)
    tx.on_failure(shared.release)

    def allocate_here() -> Any:
        shared.own = be.allocate(nbytes, rank)
        return be.export_handle(shared.own)

    received = tx.step("allocate on", allocate_here, undo=functools.partial(_abandon, be))
    be.exchanged(shared.own, received)  # who may map this rank's memory

    def map_peers() -> None:
        for r in near:
            shared.peers[r] = shared.own if r == rank else be.import_handle(received[r], r)

    tx.step("map on", map_peers)
    # Every rank mapped every peer: names and exported handles can go, and once the
    # transaction's barrier passes they are gone on every rank (a crash leaks nothing).
    be.all_mapped(shared.own)
    return shared


def _between_guards(mem: Memory, guard: int, nbytes: int) -> Memory:
    """The ``nbytes`` after the first ``guard`` bytes of reservation ``mem``, as a Memory of
    their own: its tensor covers those bytes only and holds the reservation alive."""
    tensor = backends.part_of(mem.tensor, guard, nbytes)
    return Memory(ptr=mem.ptr + guard, nbytes=nbytes, tensor=tensor, owner=mem.owner, state=mem.state)


def reserve(tx: Transaction, be: Backend, near: tuple[int, ...], nbytes: int) -> Shared:
    """Reserve address space for ``nbytes`` of this rank's memory and of every ``near`` peer's,
    each between two guards of :data:`GUARD_BYTES` that are never mapped.

    Each reservation is ``[guard | nbytes, rounded up | guard]``; its :class:`Memory`
    starts after the first guard and its tensor spans the rounded ``nbytes`` only, so
    that no tensor's storage covers a guard. Offsets of :func:`share_chunks` count from there.
    """
    rank, shared = dist.get_rank(tx.group), Shared(be, dist.get_world_size(tx.group), near)
    tx.on_failure(shared.release)
    g = be.granularity
    guard, room = round_up(GUARD_BYTES, g), round_up(nbytes, g)

    def reserve_here() -> None:
        for r in near:
            shared.peers[r] = _between_guards(be.reserve(guard + room + guard, r), guard, room)
        shared.own = shared.peers[rank]

    tx.step("reserve address space on", reserve_here)
    return shared


def share_chunks(tx: Transaction, shared: Shared, pieces: list[tuple[int, int]]) -> None:
    """Commit ``(offset, nbytes)`` pieces of this rank's reservation, map every near peer's at the same offsets."""
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
        be.chunk_exchanged(c, [received[r][1] for r in shared.near])  # who may ask for it: this node's ranks

    def map_peers() -> None:
        for r, (theirs, _) in enumerate(received):
            if r != rank and r in shared.near:
                peer = shared.peers[r]
                for off, h in theirs:
                    tx.on_failure(functools.partial(be.unmap_chunk, peer, be.map_chunk(peer, off, h)))

    tx.step("map on", map_peers)
    for c in own:
        be.chunk_all_mapped(c)


def share_local(tx: Transaction, shared: Shared, nbytes: int, known: int, max_nbytes: int) -> LocalExport:
    """Export this rank's registered memory in ``[0, nbytes)`` (the pieces wholly below
    ``known`` were exported before), map every peer's: at registration (``known`` 0) each
    peer's whole memory (a guard of :data:`GUARD_BYTES` after it), at a grow the pieces it
    grew by. The caller forgets the export (:meth:`~symmsync.backends.Backend.forget_local`)
    once the transaction committed."""
    be, rank = shared.backend, dist.get_rank(tx.group)
    export: list[LocalExport] = []

    def export_here() -> tuple[list[Piece], int]:
        export.append(be.export_local(shared.own.ptr, nbytes, rank, known=known))
        tx.on_failure(functools.partial(be.forget_local, export[0]))
        return export[0].pieces, os.getpid()

    everyone = tx.step("share the registered memory of", export_here)
    be.local_exchanged(export[0], [everyone[r][1] for r in shared.near])

    def map_peers() -> None:
        for r, (theirs, _) in enumerate(everyone):
            if r == rank or r not in shared.near:
                continue
            if not known:
                shared.peers[r] = be.import_local(theirs, r, max_nbytes, round_up(GUARD_BYTES, be.granularity))
                continue
            peer = shared.peers[r]
            for c in be.extend_local(peer, theirs):
                tx.on_failure(functools.partial(be.unmap_chunk, peer, c))

    tx.step("map the registered memory of", map_peers)
    return export[0]


def guarded(tx: Transaction, be: Backend, near: tuple[int, ...], nbytes: int) -> Shared:
    """``nbytes`` of zero-filled memory on every rank, every ``near`` peer's mapped, each mapping
    between two guards (:func:`reserve`, then :func:`share_chunks` of all of it).

    Where the backend cannot reserve address space (the CUDA backend's ``cuda_ipc``), one
    allocation per rank (:func:`allocate`), without guards.
    """
    if not be.reserves:
        return allocate(tx, be, near, nbytes)
    shared = reserve(tx, be, near, nbytes)
    share_chunks(tx, shared, [(0, round_up(nbytes, be.granularity))])
    return shared


# ---------------------------------------------------------------------- kinds
class Kind:
    """What differs between the kinds of a buffer's memory (see the module's table).

    Attributes:
        data: the memory kernels address (:attr:`SymmetricBuffer.ptrs`).
        cells: symmsync's own allocation of the cells (:func:`guarded`), apart from ``data``.
        layout: where the cells are, as offsets from the cells' base.
        max_nbytes: the most the user region can grow to; ``None`` when it cannot grow.
        registered: the memory is a runtime's, registered (:meth:`SymmetricBuffer.register`).
    """

    registered = False
    max_nbytes: int | None = None

    def __init__(self, data: Shared, layout: CellLayout, cells: Shared):
        self.data = data
        self.layout = layout
        self.cells = cells
        # Every rank's committed user bytes, for memory that commits less than it reserves.
        self._committed: list[torch.Tensor] | None = None

    @property
    def capabilities(self) -> backends.Capabilities:
        return self.cells.backend.capabilities

    def release(self) -> None:
        """Release every mapping (``close()``, or the finalizer of a buffer nobody closed). Idempotent."""
        self._committed = None
        self.data.release()
        self.cells.release()

    def cell_ptrs(self) -> list[int]:
        """The bases of every rank's cells, as mapped on this rank."""
        return self.cells.ptrs

    def user_tensor(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s user region as mapped on this rank (never the cells: they live apart).

        Its storage spans mapped bytes only: torch.compile's functionalization reads whole
        storages, and one over a guard, or over reserved address space not committed yet,
        would make it fault. The same tensor (one storage) until a grow commits more.
        """
        return self.data.peers[rank].tensor if self._committed is None else self._committed[rank]

    def _commit_views(self, nbytes: int) -> None:
        """Make :meth:`user_tensor` span the first ``nbytes`` of every rank's reservation."""
        self._committed = [None if m is None else backends.part_of(m.tensor, 0, nbytes) for m in self.data.peers]

    def cell_memory(self) -> torch.Tensor:
        return self.cells.own.tensor

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


def _cells(
    tx: Transaction, be: Backend, near: tuple[int, ...], max_views: int, channels: int
) -> tuple[Shared, CellLayout]:
    """Every rank's cells, zero, in an allocation of their own between guards, and their layout."""
    layout = CellLayout(0, dist.get_world_size(tx.group), max_views, channels)
    return guarded(tx, be, near, layout.size), layout


class Allocated(Kind):
    """Memory symmsync allocated: the user region (rounded up to the backend's
    granularity, the rest mapped and unused) between guards; the cells apart."""

    @classmethod
    def build(
        cls, group: Any, be: Backend, near: tuple[int, ...], nbytes: int, max_views: int, channels: int
    ) -> Allocated:
        with Transaction(group, "SymmetricBuffer", kept=RELEASED) as tx:
            data = guarded(tx, be, near, nbytes)
            cells, layout = _cells(tx, be, near, max_views, channels)
        return cls(data, layout, cells)


class Growable(Kind):
    """Memory symmsync allocated in address space reserved for ``max_nbytes`` between
    guards, committed as it grows; the cells apart, so growing never moves them."""

    def __init__(self, data: Shared, layout: CellLayout, cells: Shared, max_nbytes: int, committed: int):
        super().__init__(data, layout, cells)
        self.max_nbytes = max_nbytes
        self.committed = committed
        self._commit_views(committed)

    @classmethod
    def build(
        cls,
        group: Any,
        be: Backend,
        near: tuple[int, ...],
        nbytes: int,
        max_nbytes: int,
        max_views: int,
        channels: int,
    ) -> Growable:
        committed = round_up(nbytes, be.granularity)
        with Transaction(group, "SymmetricBuffer", kept=RELEASED) as tx:
            data = reserve(tx, be, near, max_nbytes)
            share_chunks(tx, data, [(0, committed)])
            cells, layout = _cells(tx, be, near, max_views, channels)
        return cls(data, layout, cells, max_nbytes, committed)

    def grow(self, group: Any, nbytes_now: int, nbytes: int) -> None:
        end = round_up(nbytes, self.data.backend.granularity)
        if end > self.committed:
            with Transaction(group, "SymmetricBuffer.grow", kept=f"the buffer keeps its {nbytes_now} bytes") as tx:
                share_chunks(tx, self.data, [(self.committed, end - self.committed)])
            self.committed = end
            self._commit_views(end)


class Adopted(Kind):
    """Memory a runtime allocated and mapped on every rank; symmsync releases only its own cells."""

    @staticmethod
    def local_problem(ptrs: Any, placement: Any, world: int) -> tuple[list[int], str | None]:
        """``(addresses, problem)`` of what :meth:`SymmetricBuffer.from_peer_addresses` was
        given (its sizes already checked): what keeps it from being adopted on this rank, or ``None``."""
        if placement == "tail":
            return [], (
                "cells='tail' is gone: symmsync keeps the cells in an allocation of its own between guards, "
                "where no store past the adopted memory reaches them; drop the cells argument"
            )
        if placement != "separate":
            return [], f"cells must be 'separate' (the default), got {placement!r}"
        try:
            ptrs = [operator.index(p) for p in ptrs]
        except TypeError:
            return [], "ptrs must be a sequence of int addresses"
        if any(not 0 < p < 2**64 for p in ptrs):
            return ptrs, f"ptrs holds {[p for p in ptrs if not 0 < p < 2**64]}, which are not addresses"
        if len(ptrs) != world:
            return ptrs, f"ptrs holds {len(ptrs)} addresses for a group of {world} ranks"
        return ptrs, None

    @classmethod
    def build(
        cls,
        group: Any,
        dev: torch.device,
        ptrs: list[int],
        nbytes: int,
        max_views: int,
        channels: int,
        options: dict[str, Any],
    ) -> Adopted:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        be = backends.adopted(dev)
        data = Shared(be, world)
        for r, p in enumerate(ptrs):
            data.peers[r] = be.import_handle(backends.Address(p, nbytes), r)
        data.own = data.peers[rank]
        cells_be = create_backend(group, backends.name_for(dev), dev, dict(options))
        with Transaction(group, "SymmetricBuffer.from_peer_addresses", kept=RELEASED) as tx:
            cells, layout = _cells(tx, cells_be, tuple(range(world)), max_views, channels)
        return cls(data, layout, cells)


class Registered(Kind):
    """Memory a runtime owns and may grow in address space it reserved; the cells apart."""

    registered = True

    def __init__(self, data: Shared, layout: CellLayout, cells: Shared, max_nbytes: int, nbytes: int, end: int):
        super().__init__(data, layout, cells)
        self.max_nbytes = max_nbytes
        self.committed = nbytes
        self._commit_views(nbytes)
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
        near: tuple[int, ...],
        ptr: int,
        nbytes: int,
        max_nbytes: int,
        max_views: int,
        channels: int,
    ) -> Registered:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        with Transaction(group, "SymmetricBuffer.register", kept="nothing stays mapped") as tx:
            cells, layout = _cells(tx, cells_be, near, max_views, channels)
            data = Shared(be, world, near)
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
            self._commit_views(nbytes)


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
