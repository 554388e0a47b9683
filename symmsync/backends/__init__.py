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
import functools
import os
import sys
import weakref
from collections.abc import Callable
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
    if backend == "host" and not kernels_interpreted():
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


#: Set by :func:`enable_interpreter_without_gpu` when ``import symmsync`` turned Triton's
#: interpreter on itself.
INTERPRETER_AUTO = False


def enable_interpreter_without_gpu() -> bool:
    """Turn on Triton's interpreter for this process where no GPU can run kernels.

    Called once by ``import symmsync``, before any symmsync kernel is defined (Triton
    decides compiled or interpreted when a ``@triton.jit`` function is defined, and
    symmsync picks its primitives then too). It sets ``TRITON_INTERPRET=1`` in this
    process's environment (inherited by its children) only when all of these hold:
    ``TRITON_INTERPRET`` is not set at all (an explicit value, ``0`` included, always
    wins), Triton's ``knobs.runtime.interpret`` was not set in code, and torch sees no
    CUDA device. On such a machine no kernel could run compiled, so nothing that
    worked before changes.

    Returns:
        True when it turned the interpreter on.
    """
    global INTERPRETER_AUTO
    if "TRITON_INTERPRET" in os.environ:
        return False
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None) if triton is not None else None
    if knobs is not None and "interpret" in vars(knobs.runtime):
        return False  # set in code: the user's choice
    try:
        if torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        pass
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRETER_AUTO = True
    if triton is not None:
        _interpret_predefined_kernels()
    return True


def _interpret_predefined_kernels() -> None:
    """Run the ``@triton.jit`` functions defined before the interpreter was turned on
    (Triton's own ``tl.sum``, ``tl.max``, ..., and any kernel defined before ``import
    symmsync``) through the interpreter too.

    Triton decides at definition: a function defined while the interpreter was off is
    a ``JITFunction``, which only runs compiled, and a call to one from an interpreted
    kernel raises. This is only done where no GPU is visible, where a compiled launch
    could not run anyway: each such function is wrapped, once, in Triton's own
    ``InterpretedFunction``, for device calls and for launches.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if getattr(JITFunction, "_symmsync_interpreted", False):
        return

    def interpreted(fn: Any) -> Any:
        wrapped = fn.__dict__.get("_symmsync_interpreted_fn")
        if wrapped is None:
            wrapped = fn.__dict__["_symmsync_interpreted_fn"] = InterpretedFunction(fn.fn)
        return wrapped

    def member(fn: Any, instance: Any, owner: Any = None) -> Any:
        # Triton's tensor methods (x.sum()) are these functions set on its tensor class.
        return functools.partial(interpreted(fn), instance) if isinstance(instance, tensor) else fn

    from triton.language.core import tensor

    JITFunction.__call__ = lambda self, *args, **kwargs: interpreted(self)(*args, **kwargs)
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: interpreted(self).run(
        *args, grid=grid, warmup=warmup, **kwargs
    )
    JITFunction.__get__ = member
    JITFunction._symmsync_interpreted = True


def kernels_interpreted() -> bool:
    """True when symmsync's kernels in this process run under Triton's interpreter
    (decided when :mod:`symmsync.language` was imported)."""
    lang = sys.modules.get("symmsync.language")
    return bool(lang.INTERPRETED) if lang is not None else interpreter_active()


def interpreter_active() -> bool:
    """True when Triton kernels defined now run under Triton's interpreter."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # pragma: no cover - older triton
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
