"""Memory backends: the one narrow interface behind :class:`symmsync.SymmetricBuffer`.

A backend knows how to allocate memory that other processes can map, how to
describe it to them (a picklable handle sent through the torch.distributed group),
how to map a peer's memory from that handle, and how to release either. Nothing
outside this package knows which backend is in use: everything above works with
:class:`Memory` (an address, a size and a zero-copy ``uint8`` tensor over it).

Backends:
    ``host``: POSIX shared memory, one segment per rank; kernels run under Triton's
        interpreter. Works on any machine, used by CI.
    ``cuda``: device memory through the CUDA driver's virtual-memory management
        (cuda-python), peers mapped over NVLink/PCIe.
"""

from __future__ import annotations

import abc
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import mode
from ..errors import BackendError, ConfigError

BACKENDS = ("host", "cuda")


@dataclass
class Memory:
    """One mapped allocation: this rank's own, or a peer's as seen from this rank.

    Attributes:
        ptr: address usable by kernels on this rank's device.
        nbytes: mapped size in bytes (at least what was asked for).
        tensor: ``uint8`` tensor of ``nbytes`` over the memory, no copy.
        owner: global rank whose memory this is.
    """

    ptr: int
    nbytes: int
    tensor: torch.Tensor
    owner: int
    state: Any = field(default=None, repr=False)


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


def name_for(device: torch.device) -> str:
    """The backend that maps memory on ``device``: ``"cuda"`` for a CUDA device, else ``"host"``."""
    return "cuda" if device.type == "cuda" else "host"


def capabilities_for(device: torch.device) -> Capabilities:
    """The capabilities of kernels that run on ``device``'s kind of memory."""
    return GPU if device.type == "cuda" else INTERPRETER


class Backend(abc.ABC):
    """Allocate, export, import, release. Implementations hold no buffer-level state.

    Attributes:
        name: shown in reprs and :attr:`SymmetricBuffer.backend`; never compared outside
            this package: ask :attr:`capabilities`.
        capabilities: what kernels over this memory do (:class:`Capabilities`).
    """

    name: str = ""
    capabilities: Capabilities = INTERPRETER

    def __init__(self, device: torch.device):
        self.device = device

    @abc.abstractmethod
    def allocate(self, nbytes: int, rank: int) -> Memory:
        """Allocate ``nbytes`` (zero-filled) that peers can map."""

    @abc.abstractmethod
    def export_handle(self, mem: Memory) -> Any:
        """A picklable description of ``mem`` that a peer passes to :meth:`import_handle`."""

    @abc.abstractmethod
    def import_handle(self, handle: Any, owner: int) -> Memory:
        """Map a peer's memory from its handle."""

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

    # ------------------------------------------------------------ growable and registered memory
    # A growable buffer (and a peer's registered memory) lives in a *reservation*: address
    # space reserved once for the largest size, where chunks of memory are mapped as the
    # buffer grows, so the base address (and every pointer table) never changes. Its
    # Memory's tensor spans the whole reservation; its state holds the chunks; the tensor
    # owns the reservation (unmapped after its last view is gone, as for allocate()).

    #: Chunks and reservations are multiples of this many bytes.
    granularity: int = 4096

    def reserve(self, nbytes: int, owner: int) -> Memory:
        """Reserve ``nbytes`` of address space (nothing mapped) for ``owner``'s memory."""
        raise BackendError(f"the {self.name} backend cannot reserve address space")

    def commit(self, mem: Memory, offset: int, nbytes: int) -> Chunk:
        """Create zero-filled memory that peers can map, at ``offset`` of this rank's reservation."""
        raise BackendError(f"the {self.name} backend cannot grow memory")

    def map_chunk(self, mem: Memory, offset: int, handle: Any) -> Chunk:
        """Map a peer's chunk (its exported ``handle``) at ``offset`` of ``mem``'s reservation."""
        raise BackendError(f"the {self.name} backend cannot map chunks")

    def unmap_chunk(self, mem: Memory, chunk: Chunk) -> None:
        """Undo :meth:`commit` or :meth:`map_chunk` (a failed grow): the range is reserved again."""
        raise BackendError(f"the {self.name} backend cannot unmap chunks")

    def export_local(self, ptr: int, nbytes: int, owner: int, known: int = 0) -> tuple[list[Any], Any]:
        """Describe memory a runtime owns, ``[ptr, ptr + nbytes)``, for its peers.

        Returns ``(handles, state)``: picklable handles of the pieces of the runtime's
        memory that cover the range, leaving out what lies below ``known`` (the
        ``state["end"]`` of an earlier call: what peers mapped already, for a grow), and
        what :meth:`forget_local` drops once every peer mapped them; ``state["end"]``
        is where the pieces mapped so far end, from ``ptr``. Raises
        :class:`~symmsync.BackendError` for memory peers cannot map.
        """
        raise BackendError(f"the {self.name} backend cannot register memory it did not allocate")

    def import_local(self, handles: list[Any], owner: int, nbytes: int) -> Memory:
        """Map a peer's registered memory from its :meth:`export_local` handles, with
        address space for ``nbytes`` (the most it may grow to)."""
        raise BackendError(f"the {self.name} backend cannot map registered memory")

    def extend_local(self, mem: Memory, handles: list[Any]) -> list[Chunk]:
        """Map the pieces a peer's registered memory grew by (``(offset, handle)`` each, as
        :meth:`export_local` gave them): all of them, or none (what was mapped is unmapped)."""
        chunks: list[Chunk] = []
        try:
            for off, handle in handles:
                chunks.append(self.map_chunk(mem, off, handle))
        except BackendError:
            for c in chunks:
                self.unmap_chunk(mem, c)
            raise
        return chunks

    def local_exchanged(self, state: Any, pids: list[int]) -> None:  # noqa: B027 - optional hook
        """Like :meth:`chunk_exchanged`, for :meth:`export_local`'s ``state``."""

    def forget_local(self, state: Any) -> None:  # noqa: B027 - optional hook
        """Drop what :meth:`export_local` kept (servers, retained handles); never the memory."""

    def chunk_exchanged(self, chunk: Chunk, pids: list[int]) -> None:  # noqa: B027 - optional hook
        """Every rank's handles arrived: ``pids`` are the process ids of the group's ranks,
        who may ask for ``chunk``."""

    def chunk_all_mapped(self, chunk: Chunk) -> None:  # noqa: B027 - optional hook
        """Like :meth:`all_mapped`, for a chunk."""


@dataclass
class Chunk:
    """A piece of memory mapped into a reservation.

    Attributes:
        offset: byte offset from the reservation's base.
        nbytes: size.
        handle: what peers pass to :meth:`Backend.map_chunk` (own chunks only).
        state: backend-specific.
    """

    offset: int
    nbytes: int
    handle: Any = None
    state: Any = field(default=None, repr=False)


def default_device() -> torch.device:
    """The device a buffer uses when none is given: the current CUDA device, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_device(device: Any) -> torch.device:
    """``torch.device(device)``, raising :class:`~symmsync.ConfigError` for what is not a device."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"device {device!r} is not a torch device ({e}); pass e.g. 'cpu' or 'cuda:0'") from e


def resolve(backend: str, device: torch.device | str | None) -> tuple[str, torch.device]:
    """Pick the backend name and device for a buffer, validating the pair."""
    if not isinstance(backend, str) or backend not in ("auto",) + BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: use one of 'auto', 'host', 'cuda'")
    dev = as_device(device) if device is not None else None
    if backend == "auto":
        if dev is None:
            # Under Triton's interpreter (TRITON_INTERPRET=1, as testing.run(backend="host")
            # sets) kernels run on the CPU: the host backend, even where GPUs exist.
            dev = torch.device("cpu") if mode.kernels_interpreted() else default_device()
        backend = "cuda" if dev.type == "cuda" else "host"
    elif dev is None:
        dev = torch.device("cpu") if backend == "host" else default_device()
    if backend == "host" and dev.type != "cpu":
        raise ConfigError(f"the host backend maps CPU memory; got device {dev}. Use device='cpu'.")
    if backend == "host" and not mode.kernels_interpreted():
        value = os.environ.get("TRITON_INTERPRET")
        why = f"TRITON_INTERPRET={value} is set" if value is not None else "a CUDA device is visible"
        raise ConfigError(
            "the host backend runs symmsync's kernels in Triton's interpreter, but this process compiled them "
            f"for a GPU when symmsync was imported ({why}). Set TRITON_INTERPRET=1 in the environment before "
            "Python starts (e.g. `TRITON_INTERPRET=1 torchrun ...`), or use backend='cuda'"
        )
    if backend == "cuda":
        if dev.type != "cuda":
            raise ConfigError(f"the cuda backend needs a CUDA device; got {dev}.")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return backend, dev


def create(backend: str, device: torch.device, **options: Any) -> Backend:
    """Instantiate a resolved backend."""
    if backend == "host":
        from .host import HostBackend

        if options:
            raise ConfigError(f"the host backend takes no options; got {sorted(options)}")
        return HostBackend(device)
    from .cuda import CudaBackend

    return CudaBackend(device, **options)


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


class AdoptedBackend(Backend):
    """Memory that a runtime allocated and mapped: symmsync wraps it and never frees it."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        # Named after the kind of memory it wraps; its kernels behave as that backend's.
        self.name = name_for(device)
        self.capabilities = capabilities_for(device)

    def allocate(self, nbytes: int, rank: int) -> Memory:
        raise BackendError("adopted memory is allocated by its owner, not by symmsync")

    def export_handle(self, mem: Memory) -> Any:
        raise BackendError("adopted memory is exchanged by its owner, not by symmsync")

    def import_handle(self, handle: Any, owner: int) -> Memory:
        ptr, nbytes = handle
        return Memory(ptr=ptr, nbytes=nbytes, tensor=tensor_at(ptr, nbytes, self.device), owner=owner)

    def release(self, mem: Memory) -> None:
        mem.tensor = None  # type: ignore[assignment]


def adopted(device: torch.device) -> Backend:
    """The backend of memory adopted from a runtime (see SymmetricBuffer.from_peer_addresses)."""
    return AdoptedBackend(device)
