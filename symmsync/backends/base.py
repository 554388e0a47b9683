"""The backend interface: what :class:`symmsync.SymmetricBuffer` asks of a kind of memory.

A backend allocates memory other processes can map, describes it to them (a picklable
handle sent through the torch.distributed group), maps a peer's memory from its handle,
and releases either. It holds no buffer-level state: the buffer (through
:mod:`symmsync.core.memory`) decides when each call happens, and runs every exchange as one
all-or-nothing :class:`~symmsync.core.agreement.Transaction`. The order of calls is written
in :class:`Backend`'s docstring.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..errors import BackendError


@dataclass(frozen=True)
class Capabilities:
    """What a backend's memory and kernels do, for the code above it to ask instead of
    comparing backend names.

    Attributes:
        traps: a kernel whose wait fails writes its record and traps, which stops the
            stream; the host learns of it at its next synchronization (GPUs).
        host_checks_status: a launch has finished when it returns, so the host reads
            the record after each one (Triton's interpreter).
        pinned_record: records live in pinned host memory, which a device kernel can
            write and the host read after a trap.
        streams: launches are asynchronous on CUDA streams: side streams, graph
            capture, ``torch.cuda.synchronize``.
        default_timeout_s: a fence's wait budget when none is given. The host budget
            allows for the interpreter on a loaded machine, the GPU one for a peer still
            compiling its first kernel.
    """

    traps: bool
    host_checks_status: bool
    pinned_record: bool
    streams: bool
    default_timeout_s: float


#: Kernels compiled for a CUDA device.
GPU = Capabilities(traps=True, host_checks_status=False, pinned_record=True, streams=True, default_timeout_s=60.0)
#: Kernels in Triton's interpreter over CPU memory.
INTERPRETER = Capabilities(
    traps=False, host_checks_status=True, pinned_record=False, streams=False, default_timeout_s=120.0
)


@dataclass
class Memory:
    """One mapped allocation: this rank's own, or a peer's as seen from this rank.

    Attributes:
        ptr: address usable by kernels on this rank's device.
        nbytes: mapped size in bytes (at least what was asked for).
        tensor: ``uint8`` tensor of ``nbytes`` over the memory, no copy.
        owner: global rank whose memory this is.
        state: the backend's record of the mapping (a dataclass of that backend), or
            ``None`` for memory the backend did not map (adopted, or a runtime's own).
    """

    ptr: int
    nbytes: int
    tensor: torch.Tensor
    owner: int
    state: Any = field(default=None, repr=False)


@dataclass
class Chunk:
    """A piece of memory mapped into a reservation.

    Attributes:
        offset: byte offset from the reservation's base.
        nbytes: size.
        handle: what peers pass to :meth:`Backend.map_chunk` (own chunks only).
        state: the backend's record of the chunk (a dataclass of that backend).
    """

    offset: int
    nbytes: int
    handle: Any = None
    state: Any = field(default=None, repr=False)


class Piece(NamedTuple):
    """A handle of memory a peer maps ``offset`` bytes from the base it maps (a chunk of
    a growable buffer, or of a runtime's registered memory; ``offset`` may be negative
    when the registered address starts inside the runtime's first allocation)."""

    offset: int
    handle: Any


@dataclass
class LocalExport:
    """What :meth:`Backend.export_local` gives for a runtime's memory.

    Attributes:
        pieces: what peers map, new since the last export (``offset`` from the registered address).
        end: where the memory peers map (after this export) ends, from the registered address.
    """

    pieces: list[Piece]
    end: int


class Backend(abc.ABC):
    """Allocate, export, import, release. Implementations hold no buffer-level state.

    The buffer calls a backend in these orders; ``[gather]`` is one exchange of every
    rank's values through the group and ``[barrier]`` the final barrier of the
    transaction. A failure on any rank, at any step, makes every rank undo what it did,
    the latest first: :meth:`abandon` for every handle it received, :meth:`unmap_chunk`,
    :meth:`forget_local` or :meth:`release` for what it mapped or kept.

    Reserve and commit (every allocation of a backend that :attr:`reserves`: a buffer's
    user region, growable or not, and the cells of every kind; ``grow`` repeats the commits).
    Each reservation holds guards around what is committed (:mod:`symmsync.core.memory`)::

        reserve(total, r) for every rank -> [gather]
        -> commit(own, offset, n) per piece -> [gather pieces, pids] -> chunk_exchanged(c, pids)
        -> map_chunk(peer, offset, handle) for every peer's piece -> [gather]
        -> chunk_all_mapped(c) -> [barrier]

    Allocate (the same allocations, where a backend cannot reserve address space: the
    CUDA backend's ``cuda_ipc``, whose memory has no guards)::

        allocate(n) -> export_handle(own) -> [gather handles] -> exchanged(own, handles)
        -> import_handle(h, r) for every peer -> [gather] -> all_mapped(own) -> [barrier]

    Register (``SymmetricBuffer.register``; its ``grow`` repeats it with ``known``)::

        export_local(ptr, n, rank, known) -> [gather pieces, pids] -> local_exchanged(export, pids)
        -> import_local(pieces, r, max_nbytes, guard) (register) or extend_local(peer, pieces) (grow)
        -> [gather] -> [barrier] -> forget_local(export)

    Close (local, any time after construction): :meth:`release` of every peer's
    :class:`Memory`, then of this rank's. A mapping itself goes with the last tensor over it.

    Attributes:
        name: shown in reprs and :attr:`SymmetricBuffer.backend`; never compared outside
            this package: ask :attr:`capabilities`.
        capabilities: what kernels over this memory do (:class:`Capabilities`).
        granularity: chunks and reservations are multiples of this many bytes.
        reserves: the backend reserves address space (:meth:`reserve`), which lets
            symmsync keep guards around every mapping; else it only allocates (:meth:`allocate`).
    """

    name: str = ""
    capabilities: Capabilities = INTERPRETER
    granularity: int = 4096
    reserves: bool = False

    def __init__(self, device: torch.device):
        self.device = device

    # ------------------------------------------------------------ allocated memory
    def allocate(self, nbytes: int, rank: int) -> Memory:
        """Allocate ``nbytes`` (zero-filled) that peers can map (a backend that does not :attr:`reserves`)."""
        raise BackendError(f"the {self.name} backend maps memory into reservations; it does not allocate")

    def export_handle(self, mem: Memory) -> Any:
        """A picklable description of ``mem`` that a peer passes to :meth:`import_handle`."""
        raise BackendError(f"the {self.name} backend exports chunks of reservations only")

    def import_handle(self, handle: Any, owner: int) -> Memory:
        """Map a peer's memory from its handle."""
        raise BackendError(f"the {self.name} backend maps chunks of reservations only")

    def exchanged(self, mem: Memory, handles: list[Any]) -> None:  # noqa: B027 - optional hook
        """Every rank's handle arrived (``handles[r]`` is rank ``r``'s, own included), before
        any peer maps ``mem``: learn who may ask for it."""

    def all_mapped(self, mem: Memory) -> None:  # noqa: B027 - optional hook
        """Called once every peer has mapped ``mem``: drop what only served the exchange."""

    @abc.abstractmethod
    def release(self, mem: Memory) -> None:
        """Unmap (peer) or free (own) memory. Called at most once per :class:`Memory`."""

    def abandon(self, handle: Any) -> None:  # noqa: B027 - optional hook
        """The exchange failed (a peer may have died): drop what ``handle`` names and only
        its owner would otherwise drop. Called for every handle received, own included."""

    # ------------------------------------------------------------ growable memory
    # A growable buffer (and a peer's registered memory) lives in a *reservation*: address
    # space reserved once for the largest size, where chunks of memory are mapped as the
    # buffer grows, so the base address (and every pointer table) never changes. Its
    # Memory's tensor spans the whole reservation; its state holds the chunks; the tensor
    # owns the reservation (unmapped after its last view is gone, as for allocate()).

    def reserve(self, nbytes: int, owner: int) -> Memory:
        """Reserve ``nbytes`` of address space (nothing mapped) for ``owner``'s memory."""
        raise BackendError(f"the {self.name} backend cannot reserve address space")

    def commit(self, mem: Memory, offset: int, nbytes: int) -> Chunk:
        """Create zero-filled memory that peers can map, at ``offset`` of this rank's reservation."""
        raise BackendError(f"the {self.name} backend cannot grow memory")

    def chunk_exchanged(self, chunk: Chunk, pids: list[int]) -> None:  # noqa: B027 - optional hook
        """Every rank's handles arrived: ``pids`` are the process ids of the group's ranks,
        who may ask for ``chunk``."""

    def map_chunk(self, mem: Memory, offset: int, handle: Any) -> Chunk:
        """Map a peer's chunk (its exported ``handle``) at ``offset`` of ``mem``'s reservation."""
        raise BackendError(f"the {self.name} backend cannot map chunks")

    def chunk_all_mapped(self, chunk: Chunk) -> None:  # noqa: B027 - optional hook
        """Like :meth:`all_mapped`, for a chunk."""

    def unmap_chunk(self, mem: Memory, chunk: Chunk) -> None:
        """Undo :meth:`commit` or :meth:`map_chunk` (a failed grow): the range is reserved again."""
        raise BackendError(f"the {self.name} backend cannot unmap chunks")

    # ------------------------------------------------------------ registered memory
    def export_local(self, ptr: int, nbytes: int, owner: int, known: int = 0) -> LocalExport:
        """Describe memory a runtime owns, ``[ptr, ptr + nbytes)``, for its peers.

        The export's pieces cover the range, leaving out what lies below ``known`` (the
        ``end`` of an earlier export: what peers mapped already, for a grow); what it
        keeps for the exchange, :meth:`forget_local` drops once every peer mapped them.
        Raises :class:`~symmsync.BackendError` for memory peers cannot map.
        """
        raise BackendError(f"the {self.name} backend cannot register memory it did not allocate")

    def local_exchanged(self, export: LocalExport, pids: list[int]) -> None:  # noqa: B027 - optional hook
        """Like :meth:`chunk_exchanged`, for :meth:`export_local`'s export."""

    def import_local(self, pieces: list[Piece], owner: int, nbytes: int, guard: int = 0) -> Memory:
        """Map a peer's registered memory from its :meth:`export_local` pieces, with
        address space for ``nbytes`` (the most it may grow to), then ``guard`` bytes of
        address space that are never mapped."""
        raise BackendError(f"the {self.name} backend cannot map registered memory")

    def extend_local(self, mem: Memory, pieces: list[Piece]) -> list[Chunk]:
        """Map the pieces a peer's registered memory grew by (as :meth:`export_local` gave
        them): all of them, or none (what was mapped is unmapped)."""
        chunks: list[Chunk] = []
        try:
            for off, handle in pieces:
                chunks.append(self.map_chunk(mem, off, handle))
        except BackendError:
            for c in chunks:
                self.unmap_chunk(mem, c)
            raise
        return chunks

    def forget_local(self, export: LocalExport) -> None:  # noqa: B027 - optional hook
        """Drop what :meth:`export_local` kept (servers, retained handles); never the memory."""


# ---------------------------------------------------------------------- tensors over mapped memory
def tensor_at(
    ptr: int, nbytes: int, device: torch.device, on_last_use: Callable[[], None] | None = None
) -> torch.Tensor:
    """A ``uint8`` tensor over ``nbytes`` at ``ptr`` on ``device``, without a copy.

    Without ``on_last_use`` the tensor does not keep the memory alive: its owner (the
    runtime that adopted it to symmsync) releases it. With ``on_last_use``, the tensor
    owns the mapping: ``on_last_use()`` runs once, when the last tensor over this
    storage (this one, or any view or slice of it) is gone, so the memory can never be
    unmapped under a live tensor. It does not run at interpreter exit, where the
    process's mappings go with the process.
    """
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        raise BackendError(f"torch {torch.__version__} cannot wrap device pointers (need >= 2.11)")
    storage = make(ptr, device, nbytes)
    t = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    if on_last_use is not None:
        # torch keeps one Python object per storage for as long as any tensor uses that
        # storage (views and slices share it), so its finalizer runs after the last use.
        weakref.finalize(t.untyped_storage(), on_last_use).atexit = False
    return t


def _hold(_owner: torch.Tensor) -> None:
    """What a part's finalizer does: nothing, once it dropped its reference to the whole."""


def part_of(whole: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor over bytes ``[offset, offset + nbytes)`` of ``whole``'s memory,
    with a storage of its own that spans those bytes only and holds ``whole`` (and so the
    mapping it owns) alive until its last view is gone.

    A slice of ``whole`` would share its storage, and torch.compile's functionalization
    reads whole storages: a part never makes it touch the bytes around it (the guards of a
    reservation, which fault).
    """
    t = tensor_at(whole.data_ptr() + offset, nbytes, whole.device)
    weakref.finalize(t.untyped_storage(), _hold, whole).atexit = False
    return t
