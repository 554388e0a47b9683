"""CUDA backend: device memory through the driver's virtual-memory management (cuda-python).

Each rank creates physical device memory with ``cuMemCreate`` (requesting a
shareable handle type), maps it into a reserved virtual range, and exports a
shareable handle. Peers import the handle, reserve their own range, map the same
physical memory, and grant their device read/write access (``cuMemSetAccess``).
docs/design.md says why this mechanism and not legacy CUDA IPC.

Handle types (the ``handle_type`` option):
    ``posix_fd`` (default): a file descriptor per allocation, passed to peers on the
        same host over a Unix socket (SCM_RIGHTS); its address travels through the
        torch.distributed group.
    ``fabric``: a fabric handle (plain bytes, sent through the group) that any GPU of
        a multi-node NVLink domain can import; needs a driver and system with fabric
        support (IMEX). Not tested here (no multi-node NVLink machine).
    ``cuda_ipc``: legacy ``cuIpcGetMemHandle`` on ``cuMemAlloc`` memory, for drivers
        or containers where shareable handles are unavailable; one host only.

Peer memory becomes a torch tensor on *this* rank's device without a copy.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from typing import Any

import torch

from ..errors import BackendError, ConfigError
from . import Backend, Memory, tensor_at

HANDLE_TYPES = ("posix_fd", "fabric", "cuda_ipc")


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python layout
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as e:
            raise BackendError(f"the cuda backend needs cuda-python (pip install cuda-python): {e}") from e
    return driver


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising on an error."""
    drv = _driver()
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)
        label = name[1].decode() if name[0] == drv.CUresult.CUDA_SUCCESS else str(err)
        raise BackendError(f"{what} failed: {label}")
    if not isinstance(result, tuple) or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class _FdServer:
    """Hands one file descriptor to every peer that connects, until closed."""

    def __init__(self, fd: int):
        self.fd = fd
        self.address = f"\0symmsync-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(64)
        self.thread = threading.Thread(target=self._serve, daemon=True, name="symmsync-fd-server")
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    socket.send_fds(conn, [b"f"], [self.fd])
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5)


def _receive_fd(address: str, owner: int) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        try:
            s.connect(address)
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
        except OSError as e:
            raise BackendError(f"could not receive rank {owner}'s memory handle over a Unix socket: {e}") from e
    if not fds:
        raise BackendError(f"rank {owner} sent no file descriptor")
    return fds[0]


class CudaBackend(Backend):
    """CUDA driver virtual-memory management with shareable handles (or legacy IPC)."""

    name = "cuda"

    def __init__(self, device: torch.device, handle_type: str = "posix_fd"):
        super().__init__(device)
        if handle_type not in HANDLE_TYPES:
            raise ConfigError(f"handle_type must be one of {HANDLE_TYPES}, got {handle_type!r}")
        if not torch.cuda.is_available():
            raise BackendError("the cuda backend needs a CUDA device, and torch sees none")
        self.handle_type = handle_type
        self.drv = drv = _driver()
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

    def _map(self, handle: Any, size: int) -> int:
        drv = self.drv
        ptr = check(drv.cuMemAddressReserve(size, self.granularity, 0, 0), "cuMemAddressReserve")
        try:
            check(drv.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
            try:
                check(drv.cuMemSetAccess(ptr, size, [self.access], 1), "cuMemSetAccess")
            except BackendError:
                drv.cuMemUnmap(ptr, size)
                raise
        except BackendError:
            drv.cuMemAddressFree(ptr, size)
            raise
        return int(ptr)

    def _unmap(self, ptr: int, size: int) -> None:
        self.drv.cuMemUnmap(ptr, size)
        self.drv.cuMemAddressFree(ptr, size)

    # ------------------------------------------------------------------ interface
    def allocate(self, nbytes: int, rank: int) -> Memory:
        drv = self.drv
        if self.handle_type == "cuda_ipc":
            ptr = int(check(drv.cuMemAlloc(nbytes), "cuMemAlloc"))
            size = nbytes
            state = {"kind": "ipc-own", "size": size}
        else:
            size = self._round(nbytes)
            handle = check(drv.cuMemCreate(size, self.prop, 0), f"cuMemCreate({size} bytes)")
            try:
                ptr = self._map(handle, size)
            except BackendError:
                drv.cuMemRelease(handle)
                raise
            state = {"kind": "vmm-own", "handle": handle, "size": size}
        check(drv.cuMemsetD8(ptr, 0, size), "cuMemsetD8")
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        return Memory(ptr=ptr, nbytes=nbytes, tensor=tensor_at(ptr, nbytes, self.device), owner=rank, state=state)

    def export_handle(self, mem: Memory) -> Any:
        drv = self.drv
        st = mem.state
        if self.handle_type == "cuda_ipc":
            h = check(drv.cuIpcGetMemHandle(mem.ptr), "cuIpcGetMemHandle")
            return ("cuda_ipc", bytes(h.reserved), mem.nbytes)
        shareable = check(
            drv.cuMemExportToShareableHandle(st["handle"], self.cu_handle_type, 0),
            f"cuMemExportToShareableHandle({self.handle_type})",
        )
        if self.handle_type == "fabric":
            return ("fabric", bytes(shareable.data), st["size"], mem.nbytes)
        st["fd"] = int(shareable)
        st["server"] = _FdServer(st["fd"])
        return ("posix_fd", st["server"].address, st["size"], mem.nbytes)

    def import_handle(self, handle: Any, owner: int) -> Memory:
        drv = self.drv
        kind = handle[0]
        if kind == "cuda_ipc":
            h = drv.CUipcMemHandle()
            h.reserved = handle[1]
            ptr = int(
                check(
                    drv.cuIpcOpenMemHandle(h, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                    f"cuIpcOpenMemHandle(rank {owner})",
                )
            )
            nbytes = handle[2]
            return Memory(
                ptr=ptr,
                nbytes=nbytes,
                tensor=tensor_at(ptr, nbytes, self.device),
                owner=owner,
                state={"kind": "ipc-peer"},
            )
        size, nbytes = handle[2], handle[3]
        if kind == "posix_fd":
            fd = _receive_fd(handle[1], owner)
            try:
                phys = check(
                    drv.cuMemImportFromShareableHandle(fd, self.cu_handle_type),
                    f"cuMemImportFromShareableHandle(rank {owner})",
                )
            finally:
                os.close(fd)
        else:
            fh = drv.CUmemFabricHandle()
            fh.data = handle[1]
            phys = check(
                drv.cuMemImportFromShareableHandle(fh, self.cu_handle_type),
                f"cuMemImportFromShareableHandle(fabric, rank {owner})",
            )
        try:
            ptr = self._map(phys, size)
        finally:
            drv.cuMemRelease(phys)  # the mapping holds the memory from here on
        return Memory(
            ptr=ptr,
            nbytes=nbytes,
            tensor=tensor_at(ptr, nbytes, self.device),
            owner=owner,
            state={"kind": "vmm-peer", "size": size},
        )

    def all_mapped(self, mem: Memory) -> None:
        st = mem.state
        server = st.pop("server", None)
        if server is not None:
            server.close()
        fd = st.pop("fd", None)
        if fd is not None:
            os.close(fd)

    def release(self, mem: Memory) -> None:
        drv = self.drv
        self.all_mapped(mem)
        st = mem.state
        mem.tensor = None  # type: ignore[assignment]
        try:
            torch.cuda.synchronize(self.device)  # no kernel may still touch the mapping
        except RuntimeError:
            pass  # a trapped kernel: the context is gone, unmapping below still tidies up
        kind = st.get("kind")
        if kind == "vmm-own":
            self._unmap(mem.ptr, st["size"])
            drv.cuMemRelease(st["handle"])
        elif kind == "vmm-peer":
            self._unmap(mem.ptr, st["size"])
        elif kind == "ipc-own":
            drv.cuMemFree(mem.ptr)
        elif kind == "ipc-peer":
            drv.cuIpcCloseMemHandle(mem.ptr)
        st["kind"] = "released"
