"""CUDA backend: device memory through the driver's virtual-memory management (cuda-python).

Each rank reserves a virtual range (``cuMemAddressReserve``), creates physical device
memory with ``cuMemCreate`` (requesting a shareable handle type), maps it into the range,
and exports a shareable handle. Peers import the handle, map the same physical memory at
the same offset of their own range for that rank, and grant their device read/write
access (``cuMemSetAccess``). What of a range is not mapped (the guards symmsync keeps
around every mapping) makes a kernel that stores there trap with an illegal address.
docs/design.md says why this mechanism and not legacy CUDA IPC.

Handle types (the ``handle_type`` option):
    ``posix_fd`` (default): a file descriptor per allocation, passed to peers on the
        same host over a Unix socket (SCM_RIGHTS); its address travels through the
        torch.distributed group.
    ``fabric``: a fabric handle (plain bytes, sent through the group) that any GPU of
        a multi-node NVLink domain can import; needs a driver and system with fabric
        support (IMEX). Not tested here (no multi-node NVLink machine).
    ``cuda_ipc``: legacy ``cuIpcGetMemHandle`` on ``cuMemAlloc`` memory, for drivers
        or containers where shareable handles are unavailable; one host only. It
        reserves no address space: no guards, and no growable buffers.

Peer memory becomes a torch tensor on *this* rank's device without a copy. The
tensors own their mappings: every mapping, own or peer, is unmapped when the last
tensor over it is gone, so a tensor kept past :meth:`SymmetricBuffer.close` stays
valid instead of pointing at unmapped memory.

A ``posix_fd`` descriptor travels through :mod:`symmsync.backends.fd_passing`, which
serves it only to the group's ranks.

Peers receive a :class:`PosixFdHandle`, :class:`FabricHandle` or :class:`CudaIpcHandle`;
this rank keeps one dataclass per kind of mapping (``_Reservation``, ``_IpcOwn``, ...).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from ..errors import BackendError, ConfigError
from .base import GPU, Backend, Chunk, LocalExport, Memory, Piece, tensor_at
from .driver import check, driver
from .fd_passing import FdServer, receive_fd

HANDLE_TYPES = ("posix_fd", "fabric", "cuda_ipc")

log = logging.getLogger("symmsync")


# ---------------------------------------------------------------------- handles (sent to peers)
class PosixFdHandle(NamedTuple):
    """``size`` bytes of physical memory, whose file descriptor the owner's process
    ``pid`` serves on the Unix socket ``address``."""

    address: str
    size: int
    pid: int


class FabricHandle(NamedTuple):
    """``size`` bytes of physical memory as a fabric handle's bytes."""

    data: bytes
    size: int


class CudaIpcHandle(NamedTuple):
    """A legacy IPC handle (``cuIpcGetMemHandle``) of a ``size``-byte device allocation."""

    raw: bytes
    size: int


# ---------------------------------------------------------------------- what this rank keeps
@dataclass
class _Exchange:
    """What only serves an exchange of handles (``posix_fd``): the descriptor server and the descriptor."""

    server: FdServer | None = None
    fd: int | None = None

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


@dataclass
class _Mapping:
    """A mapping its last tensor owns: unmapped (and own memory freed) once, after that tensor is gone."""

    label: ClassVar[str] = ""
    released: bool = field(default=False, init=False)

    def unmap(self, drv: Any, ptr: int) -> None:
        raise NotImplementedError


@dataclass
class _IpcOwn(_Mapping):
    """This rank's ``cuMemAlloc`` memory (``handle_type="cuda_ipc"``)."""

    label: ClassVar[str] = "ipc-own"

    def unmap(self, drv: Any, ptr: int) -> None:
        drv.cuMemFree(ptr)


@dataclass
class _IpcPeer(_Mapping):
    """A peer's allocation opened with ``cuIpcOpenMemHandle`` at ``opened`` (the mapping's
    address unless the memory starts inside it: registered memory)."""

    label: ClassVar[str] = "ipc-peer"
    opened: int | None = None

    def unmap(self, drv: Any, ptr: int) -> None:
        drv.cuIpcCloseMemHandle(self.opened if self.opened is not None else ptr)


@dataclass
class _Reservation(_Mapping):
    """Address space ``[base, base + size)`` and the chunks mapped into it (a buffer's
    memory, its cells, or a peer's registered memory), then ``guard`` bytes reserved
    that are never mapped."""

    label: ClassVar[str] = "reservation"
    base: int
    size: int
    guard: int = 0
    chunks: list[Chunk] = field(default_factory=list)

    def unmap(self, drv: Any, ptr: int) -> None:
        for chunk in self.chunks:
            _release_chunk(drv, chunk)
        _warn_if_failed(drv, drv.cuMemAddressFree(self.base, self.size + self.guard), "cuMemAddressFree")


@dataclass
class _ChunkMapping:
    """A chunk mapped at ``at``; ``handle`` is its physical memory when this rank created it."""

    at: int
    handle: Any = None
    exchange: _Exchange = field(default_factory=_Exchange)
    released: bool = False


@dataclass
class _Retained:
    """One VMM allocation of a runtime's registered memory, retained for its export."""

    handle: Any
    exchange: _Exchange = field(default_factory=_Exchange)


@dataclass
class _CudaExport(LocalExport):
    """An export of registered memory, with the allocations it retained."""

    retained: list[_Retained] = field(default_factory=list)


#: Releases whose last tensor died while a CUDA graph was being captured (synchronizing
#: then would break the capture): done by the backend's next allocate or release.
_deferred: list[functools.partial] = []


def _flush_deferred() -> None:
    while _deferred and not torch.cuda.is_current_stream_capturing():
        _deferred.pop()()


def _unmap_when_unused(drv: Any, device: torch.device, ptr: int, state: _Mapping) -> None:
    """Unmap (and, for own memory, free) one mapping: runs once, after its last tensor is gone."""
    if state.released:
        return
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        capturing = False
    if capturing:
        _deferred.append(functools.partial(_unmap_when_unused, drv, device, ptr, state))
        return
    state.released = True
    try:
        torch.cuda.synchronize(device)  # no kernel may still touch the mapping
    except RuntimeError:
        pass  # a trapped kernel: the context is gone, unmapping below still tidies up
    try:
        state.unmap(drv, ptr)
    except Exception as e:  # noqa: BLE001 - runs from a finalizer: report, never raise
        log.warning("could not release %s memory at 0x%x: %s", state.label, ptr, e)


def _release_chunk(drv: Any, chunk: Chunk) -> None:
    """Unmap one chunk of a reservation (at the address it was mapped at); release its
    physical memory if this rank created it."""
    st: _ChunkMapping = chunk.state
    if st.released:
        return
    st.released = True
    _warn_if_failed(drv, drv.cuMemUnmap(st.at, chunk.nbytes), "cuMemUnmap")
    if st.handle is not None:
        _warn_if_failed(drv, drv.cuMemRelease(st.handle), "cuMemRelease")
    st.exchange.close()


def _warn_if_failed(drv: Any, result: Any, what: str) -> None:
    """Log a failed release (it runs where nothing may raise: finalizers, error paths)."""
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        log.warning("%s failed: %s", what, err)


class CudaBackend(Backend):
    """CUDA driver virtual-memory management with shareable handles (or legacy IPC)."""

    name = "cuda"
    capabilities = GPU

    def __init__(self, device: torch.device, handle_type: str = "posix_fd"):
        super().__init__(device)
        if handle_type not in HANDLE_TYPES:
            raise ConfigError(f"handle_type must be one of {HANDLE_TYPES}, got {handle_type!r}")
        if not torch.cuda.is_available():
            raise BackendError("the cuda backend needs a CUDA device, and torch sees none")
        self.handle_type = handle_type
        self.reserves = handle_type != "cuda_ipc"
        self.drv = drv = driver()
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # make torch's primary context current on this thread
        check(drv.cuInit(0), "cuInit")
        self.cu_device = check(drv.cuDeviceGet(device.index), "cuDeviceGet")
        if handle_type == "cuda_ipc":
            return
        vmm = check(
            drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self.cu_device
            ),
            "cuDeviceGetAttribute(VMM)",
        )
        if not vmm:
            raise BackendError(f"{device} does not support virtual memory management; try handle_type='cuda_ipc'")
        kinds = drv.CUmemAllocationHandleType
        self.cu_handle_type = {
            "posix_fd": kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            "fabric": kinds.CU_MEM_HANDLE_TYPE_FABRIC,
        }[handle_type]
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        prop.requestedHandleTypes = self.cu_handle_type
        self.prop = prop
        self.granularity = check(
            drv.cuMemGetAllocationGranularity(
                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
            "cuMemGetAllocationGranularity",
        )
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access

    # ------------------------------------------------------------------ helpers
    def _round(self, nbytes: int) -> int:
        g = self.granularity
        return (nbytes + g - 1) // g * g

    def _tensor(self, ptr: int, nbytes: int, state: _Mapping) -> torch.Tensor:
        """The mapping's tensor; it owns the mapping (released after its last view is gone).

        The finalizer holds the driver, the address and the state, never the tensor or
        its Memory (that would keep the tensor alive forever).
        """
        release = functools.partial(_unmap_when_unused, self.drv, self.device, ptr, state)
        return tensor_at(ptr, nbytes, self.device, on_last_use=release)

    def _memory(self, ptr: int, nbytes: int, owner: int, state: _Mapping) -> Memory:
        return Memory(ptr=ptr, nbytes=nbytes, tensor=self._tensor(ptr, nbytes, state), owner=owner, state=state)

    def _open_ipc(self, raw: bytes, owner: int) -> int:
        h = self.drv.CUipcMemHandle()
        h.reserved = raw
        return int(
            check(
                self.drv.cuIpcOpenMemHandle(h, self.drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                f"cuIpcOpenMemHandle(rank {owner})",
            )
        )

    # ------------------------------------------------------------------ allocated memory (cuda_ipc)
    def allocate(self, nbytes: int, rank: int) -> Memory:
        if self.reserves:
            return super().allocate(nbytes, rank)
        _flush_deferred()
        drv = self.drv
        ptr = int(check(drv.cuMemAlloc(nbytes), "cuMemAlloc"))
        check(drv.cuMemsetD8(ptr, 0, nbytes), "cuMemsetD8")
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        return self._memory(ptr, nbytes, rank, _IpcOwn())

    def export_handle(self, mem: Memory) -> CudaIpcHandle:
        h = check(self.drv.cuIpcGetMemHandle(mem.ptr), "cuIpcGetMemHandle")
        return CudaIpcHandle(raw=bytes(h.reserved), size=mem.nbytes)

    def import_handle(self, handle: CudaIpcHandle, owner: int) -> Memory:
        ptr = self._open_ipc(handle.raw, owner)
        return self._memory(ptr, handle.size, owner, _IpcPeer())

    def release(self, mem: Memory) -> None:
        """Close the handle servers and drop symmsync's tensor over ``mem``.

        The mapping itself goes with the last tensor over it (:meth:`_tensor`): at once
        when nobody else holds one, else when the user's last tensor is gone.
        """
        if isinstance(mem.state, _Reservation):
            for chunk in mem.state.chunks:
                self.chunk_all_mapped(chunk)
        mem.tensor = None  # type: ignore[assignment]
        _flush_deferred()

    # ------------------------------------------------------------ growable memory
    def _need_vmm(self, what: str) -> None:
        if self.handle_type == "cuda_ipc":
            raise BackendError(f"{what} needs the driver's virtual-memory management; handle_type='cuda_ipc' has none")

    def _reservation(self, size: int, guard: int = 0) -> _Reservation:
        total = size + guard
        base = int(check(self.drv.cuMemAddressReserve(total, self.granularity, 0, 0), "cuMemAddressReserve"))
        return _Reservation(base=base, size=size, guard=guard)

    def reserve(self, nbytes: int, owner: int) -> Memory:
        self._need_vmm("a growable buffer")
        _flush_deferred()
        state = self._reservation(self._round(nbytes))
        return self._memory(state.base, state.size, owner, state)

    def _map_at(self, at: int, size: int, phys: Any) -> None:
        drv = self.drv
        check(drv.cuMemMap(at, size, 0, phys, 0), "cuMemMap")
        try:
            check(drv.cuMemSetAccess(at, size, [self.access], 1), "cuMemSetAccess")
        except BackendError:
            drv.cuMemUnmap(at, size)
            raise

    def _in_reservation(self, mem: Memory, offset: int, nbytes: int) -> int:
        st: _Reservation = mem.state
        at = mem.ptr + offset
        if not (st.base <= at and at + nbytes <= st.base + st.size):
            raise BackendError(
                f"bytes [{offset}, {offset + nbytes}) of rank {mem.owner}'s memory lie outside the "
                f"{st.size} bytes of address space reserved for it"
            )
        return at

    def _export_chunk(self, handle: Any, size: int, owner: int, exchange: _Exchange) -> PosixFdHandle | FabricHandle:
        """The handle peers map ``size`` bytes of physical memory with: fabric bytes, or
        the address of a descriptor server kept in ``exchange``."""
        shareable = check(
            self.drv.cuMemExportToShareableHandle(handle, self.cu_handle_type, 0),
            f"cuMemExportToShareableHandle({self.handle_type})",
        )
        if self.handle_type == "fabric":
            return FabricHandle(data=bytes(shareable.data), size=size)
        exchange.fd = int(shareable)
        exchange.server = FdServer(exchange.fd, owner=owner)
        return PosixFdHandle(address=exchange.server.address, size=size, pid=os.getpid())

    def _import_phys(self, handle: PosixFdHandle | FabricHandle, owner: int) -> Any:
        drv = self.drv
        if isinstance(handle, PosixFdHandle):
            fd = receive_fd(handle.address, owner, handle.pid)
            try:
                return check(
                    drv.cuMemImportFromShareableHandle(fd, self.cu_handle_type),
                    f"cuMemImportFromShareableHandle(rank {owner})",
                )
            finally:
                os.close(fd)
        fh = drv.CUmemFabricHandle()
        fh.data = handle.data
        return check(
            drv.cuMemImportFromShareableHandle(fh, self.cu_handle_type),
            f"cuMemImportFromShareableHandle(fabric, rank {owner})",
        )

    def commit(self, mem: Memory, offset: int, nbytes: int) -> Chunk:
        drv = self.drv
        at = self._in_reservation(mem, offset, nbytes)
        phys = check(drv.cuMemCreate(nbytes, self.prop, 0), f"cuMemCreate({nbytes} bytes)")
        state = _ChunkMapping(at=at, handle=phys)
        chunk = Chunk(offset=offset, nbytes=nbytes, state=state)
        try:
            self._map_at(at, nbytes, phys)
        except BackendError:
            drv.cuMemRelease(phys)
            raise
        mem.state.chunks.append(chunk)
        try:
            check(drv.cuMemsetD8(at, 0, nbytes), "cuMemsetD8")
            check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            chunk.handle = self._export_chunk(phys, nbytes, mem.owner, state.exchange)
        except Exception as e:  # an OSError from the descriptor server too: nothing may stay mapped
            self.unmap_chunk(mem, chunk)
            raise e if isinstance(e, BackendError) else BackendError(f"exporting a chunk failed: {e}") from e
        return chunk

    def chunk_exchanged(self, chunk: Chunk, pids: list[int]) -> None:
        server = chunk.state.exchange.server
        if server is not None:
            server.expect(pids)

    def map_chunk(self, mem: Memory, offset: int, handle: PosixFdHandle | FabricHandle) -> Chunk:
        size = handle.size
        at = self._in_reservation(mem, offset, size)
        phys = self._import_phys(handle, mem.owner)
        try:
            self._map_at(at, size, phys)
        finally:
            self.drv.cuMemRelease(phys)  # the mapping holds the memory from here on
        chunk = Chunk(offset=offset, nbytes=size, state=_ChunkMapping(at=at))
        mem.state.chunks.append(chunk)
        return chunk

    def chunk_all_mapped(self, chunk: Chunk) -> None:
        chunk.state.exchange.close()

    def unmap_chunk(self, mem: Memory, chunk: Chunk) -> None:
        try:
            torch.cuda.synchronize(self.device)  # no kernel may still touch it
        except RuntimeError:
            pass
        _release_chunk(self.drv, chunk)
        if chunk in mem.state.chunks:
            mem.state.chunks.remove(chunk)

    # ------------------------------------------------------------ registered memory
    def _allocations(self, ptr: int, nbytes: int) -> list[tuple[int, int, Any]]:
        """``(base, size, retained handle)`` of every VMM allocation mapped over
        ``[ptr, ptr + nbytes)``, or ``[]`` when the memory is not VMM memory."""
        drv = self.drv
        found: list[tuple[int, int, Any]] = []
        at, end = ptr, ptr + nbytes
        while at < end:
            err, handle = drv.cuMemRetainAllocationHandle(at)
            if err != drv.CUresult.CUDA_SUCCESS:
                if not found:
                    return []  # not VMM memory: the caller tries CUDA IPC
                for _, _, h in found:
                    drv.cuMemRelease(h)
                raise BackendError(
                    f"the registered memory is not mapped at {at:#x} ({at - ptr} bytes in): "
                    f"cuMemRetainAllocationHandle gave {err}; register only what the runtime committed"
                )
            base, size = check(drv.cuMemGetAddressRange(at), "cuMemGetAddressRange")
            found.append((int(base), int(size), handle))
            at = int(base) + int(size)
        return found

    def export_local(self, ptr: int, nbytes: int, owner: int, known: int = 0) -> _CudaExport:
        _flush_deferred()
        drv = self.drv
        allocations = self._allocations(ptr, nbytes) if self.handle_type != "cuda_ipc" else []
        # Every retained handle is in the export before any export, so a failure releases all.
        export = _CudaExport(pieces=[], end=known, retained=[_Retained(handle=h) for _, _, h in allocations])
        if allocations:
            try:
                for (base, size, h), kept in zip(allocations, export.retained):
                    export.end = max(export.end, base + size - ptr)
                    if base + size - ptr <= known:
                        continue  # peers mapped this chunk at an earlier call (known ends a chunk)
                    export.pieces.append(Piece(base - ptr, self._export_chunk(h, size, owner, kept.exchange)))
            except Exception as e:  # an OSError from a descriptor server too
                self.forget_local(export)
                raise BackendError(
                    f"{e}: the runtime's allocation cannot be exported as {self.handle_type!r}; create it with "
                    "that handle type in CUmemAllocationProp.requestedHandleTypes"
                ) from e
            return export
        # A plain device allocation (torch's caching allocator, cudaMalloc): CUDA IPC.
        base, size = check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        base, size = int(base), int(size)
        if ptr + nbytes > base + size:
            raise BackendError(
                f"the registered range [{ptr:#x}, {ptr + nbytes:#x}) leaves its device allocation "
                f"[{base:#x}, {base + size:#x}); memory shared through CUDA IPC cannot grow past its allocation"
            )
        export.end = base + size - ptr
        if known:
            return export  # within the allocation peers opened already
        h = check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        export.pieces.append(Piece(base - ptr, CudaIpcHandle(raw=bytes(h.reserved), size=size)))
        return export

    def local_exchanged(self, export: _CudaExport, pids: list[int]) -> None:
        for kept in export.retained:
            if kept.exchange.server is not None:
                kept.exchange.server.expect(pids)

    def forget_local(self, export: _CudaExport) -> None:
        for kept in export.retained:
            kept.exchange.close()
            h, kept.handle = kept.handle, None
            if h is not None:
                self.drv.cuMemRelease(h)

    def import_local(self, pieces: list[Piece], owner: int, nbytes: int, guard: int = 0) -> Memory:
        if not pieces:
            raise BackendError(f"rank {owner} registered no memory")
        first = pieces[0].handle
        if isinstance(first, CudaIpcHandle):
            delta = -pieces[0].offset  # the registered address, from the start of its allocation
            opened = self._open_ipc(first.raw, owner)
            view = min(nbytes, first.size - delta)
            return self._memory(opened + delta, view, owner, _IpcPeer(opened=opened))
        delta = -min(p.offset for p in pieces)  # the registered address may start inside a chunk
        largest = max(p.handle.size for p in pieces)
        # Room for a last chunk past max_nbytes, then the guard (never mapped: past state.size).
        state = self._reservation(self._round(delta + nbytes + largest), self._round(guard))
        mem = self._memory(state.base + delta, nbytes, owner, state)
        self.extend_local(mem, pieces)
        return mem
