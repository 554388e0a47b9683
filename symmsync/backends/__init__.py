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
from dataclasses import dataclass, field
from typing import Any

import torch

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


class Backend(abc.ABC):
    """Allocate, export, import, release. Implementations hold no buffer-level state."""

    name: str = ""

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

    def all_mapped(self, mem: Memory) -> None:  # noqa: B027 - optional hook
        """Called once every peer has mapped ``mem``: drop what only served the exchange."""

    @abc.abstractmethod
    def release(self, mem: Memory) -> None:
        """Unmap (peer) or free (own) memory. Called at most once per :class:`Memory`."""

    def abandon(self, handle: Any) -> None:  # noqa: B027 - optional hook
        """The exchange failed (a peer may have died): drop what ``handle`` names and only
        its owner would otherwise drop. Called for every handle received, own included."""


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
            dev = torch.device("cpu") if interpreter_active() else default_device()
        backend = "cuda" if dev.type == "cuda" else "host"
    elif dev is None:
        dev = torch.device("cpu") if backend == "host" else default_device()
    if backend == "host" and dev.type != "cpu":
        raise ConfigError(f"the host backend maps CPU memory; got device {dev}. Use device='cpu'.")
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


def tensor_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor over ``nbytes`` at ``ptr`` on ``device``; no copy, no ownership.

    The tensor does not keep the memory alive: its owner (a buffer's backend, or the
    runtime that adopted it to symmsync) releases it.
    """
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        raise BackendError(f"torch {torch.__version__} cannot wrap device pointers (need >= 2.11)")
    storage = make(ptr, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class AdoptedBackend(Backend):
    """Memory that a runtime allocated and mapped: symmsync wraps it and never frees it."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.name = "cuda" if device.type == "cuda" else "host"

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


def interpreter_active() -> bool:
    """True when Triton kernels defined now run under Triton's interpreter."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # pragma: no cover - older triton
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
