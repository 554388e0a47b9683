"""Memory backends: the one narrow interface behind :class:`symmsync.SymmetricBuffer`.

A backend knows how to allocate memory that other processes can map, how to
describe it to them (a picklable handle sent through the torch.distributed group),
how to map a peer's memory from that handle, and how to release either; the
interface and the order of its calls are in :mod:`symmsync.backends.base`. Nothing
outside this package knows which backend is in use: everything above works with
:class:`Memory` (an address, a size and a zero-copy ``uint8`` tensor over it).
This module picks a backend (:func:`resolve`, :func:`create`); the backends import
nothing from it (what they share, such as wrapping memory as tensors, :func:`tensor_at`
and :func:`part_of`, lives in :mod:`symmsync.backends.base`).

Backends:
    ``host``: POSIX shared memory, one segment per rank; kernels run under Triton's
        interpreter. Works on any machine, used by CI.
    ``cuda``: device memory through the CUDA driver's virtual-memory management
        (cuda-python), peers mapped over NVLink/PCIe.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ..errors import BackendError, CaptureError, ConfigError
from . import mode
from .base import GPU, INTERPRETER, Backend, Capabilities, Chunk, LocalExport, Memory, Piece, part_of, tensor_at

__all__ = [
    "BACKENDS",
    "Address",
    "GPU",
    "INTERPRETER",
    "Backend",
    "Capabilities",
    "Chunk",
    "LocalExport",
    "Memory",
    "Piece",
    "adopted",
    "as_device",
    "capabilities_for",
    "capturing",
    "compiling",
    "create",
    "default_device",
    "name_for",
    "part_of",
    "refuse_compiling",
    "resolve",
    "tensor_at",
]

BACKENDS = ("host", "cuda")


def name_for(device: torch.device) -> str:
    """The backend that maps memory on ``device``: ``"cuda"`` for a CUDA device, else ``"host"``."""
    return "cuda" if device.type == "cuda" else "host"


def capture_error(where: str, why: str, instead: str) -> CaptureError:
    """The one wording of a call refused because its stream is capturing a CUDA graph
    (:func:`capturing`): ``where`` (``"rank 0: Fence"``), why a graph cannot hold the call, and
    what to do instead. Raised by constructors (:mod:`symmsync.core.agreement`, the fence) and
    by a call over nodes (:mod:`symmsync.spanning.exchange`)."""
    return CaptureError(
        f"{where}: called while a CUDA graph was being captured on its current stream; {why}. {instead}"
    )


def compiling() -> bool:
    """True while ``torch.compile`` traces the caller (Dynamo), or runs it inside a compiled
    function's frames: code a graph break hands back to Python, where Dynamo's frame callback is
    still set (the test torch's own ``set_stance`` makes). False in plain eager code and inside
    a ``torch.compiler.disable``-d function."""
    if torch.compiler.is_compiling():
        return True
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    callback = get_eval_frame_callback()
    return callback is not None and callback is not False


def refuse_compiling(call: str) -> None:
    """Raise the one :class:`~symmsync.ConfigError` of a collective set-up call (a constructor,
    ``view``, ``grow``, ``claim``, the writer's ``prepare``) made inside a function that
    ``torch.compile`` compiles (:func:`compiling`). Every rank that runs the function raises it,
    before any exchange. Under ``fullgraph=True`` Dynamo reports it as its own ``Unsupported``,
    whose text carries this error; without, this error itself reaches the caller."""
    if compiling():
        import torch.distributed as dist

        who = f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""
        raise ConfigError(
            f"{who}{call}: called inside a function that torch.compile compiles; a set-up call is collective "
            "and allocates, maps or exchanges with the other ranks, which a compiled graph cannot hold. Make it "
            "before compiling, in eager code (docs/inside-a-model.md, 'Create everything before compiling and "
            "capturing')"
        )


def capabilities_for(device: torch.device) -> Capabilities:
    """The capabilities of kernels that run on ``device``'s kind of memory."""
    return GPU if device.type == "cuda" else INTERPRETER


def default_device() -> torch.device:
    """The device a buffer uses when none is given: the current CUDA device, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def capturing(device: torch.device | None) -> bool:
    """True when ``device`` is a CUDA device whose current stream is capturing a CUDA graph.

    What a buffer, a view or a fence does at creation (allocate, map, copy a table to
    the device, compile) is what a capture cannot record, so they refuse to be made then
    (:class:`~symmsync.errors.CaptureError`). Asks torch only (no device work); False for any
    other device, where CUDA was never initialized in this process, and where the context
    is unusable (after a trap), so that ``close()`` never raises for asking.
    """
    if device is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return False
    try:
        if device.index is None or device.index == torch.cuda.current_device():
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a context a trap made unusable answers with its error: no capture runs there
        return False


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


class Address(NamedTuple):
    """The handle of adopted memory: where a runtime mapped it on this rank, and its size."""

    ptr: int
    nbytes: int


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

    def import_handle(self, handle: Address, owner: int) -> Memory:
        return Memory(ptr=handle.ptr, nbytes=handle.nbytes, tensor=tensor_at(*handle, self.device), owner=owner)

    def release(self, mem: Memory) -> None:
        mem.tensor = None  # type: ignore[assignment]


def adopted(device: torch.device) -> Backend:
    """The backend of memory adopted from a runtime (see SymmetricBuffer.from_peer_addresses)."""
    return AdoptedBackend(device)
