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

Peer memory becomes a torch tensor on *this* rank's device without a copy. The
tensors own their mappings: every mapping, own or peer, is unmapped when the last
tensor over it is gone, so a tensor kept past :meth:`SymmetricBuffer.close` stays
valid instead of pointing at unmapped memory.

The descriptor server (``posix_fd``) answers only the group's ranks: each rank's
handle carries its process id, and a connection is served only when the kernel's
credentials of the connecting process (``SO_PEERCRED``) show this user and the
process id of a rank that has not been served yet. docs/guarantees.md says what
that protects against on a shared host.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Collection
from typing import Any

import torch

from ..errors import BackendError, ConfigError
from . import GPU, Backend, Chunk, Memory, tensor_at

HANDLE_TYPES = ("posix_fd", "fabric", "cuda_ipc")


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python layout
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as e:
            raise BackendError(
                "the cuda backend needs cuda-python, which is not installed: pip install 'symmsync[cuda]' "
                f"(or pip install cuda-python) ({e})"
            ) from e
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


log = logging.getLogger("symmsync")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket,
    as the kernel recorded them at connect time (``SO_PEERCRED``)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


class _FdServer:
    """Hands one file descriptor to each of the group's other ranks, once, then closes.

    Listens on an abstract Unix socket (its name travels through the group). The
    process ids it may serve are the peers' (:meth:`expect`, from the same exchange
    that carried the socket's name); a connection that arrives before them waits for
    them. Every connection is checked with ``SO_PEERCRED``: the same effective user
    as this process and an expected process id not served yet get the descriptor;
    anything else gets nothing and is logged (logger ``"symmsync"``). Once every
    expected peer has its descriptor the socket closes.
    """

    def __init__(self, fd: int, owner: int = -1, wait_s: float = 60.0):
        self.fd = fd
        self.owner = owner
        self.wait_s = wait_s
        self.address = f"\0symmsync-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(64)
        self._expected: set[int] | None = None
        self._served: set[int] = set()
        self._known = threading.Event()
        self._closed = False
        self.thread = threading.Thread(target=self._serve, daemon=True, name="symmsync-fd-server")
        self.thread.start()

    def expect(self, pids: Collection[int]) -> None:
        """The process ids of the ranks that will connect (this process's excluded)."""
        self._expected = set(pids) - {os.getpid()}
        self._known.set()

    @property
    def served(self) -> frozenset[int]:
        """Process ids that received the descriptor."""
        return frozenset(self._served)

    def _serve(self) -> None:
        while True:
            if self._expected is not None and self._served >= self._expected:
                self._close_socket()  # every peer has its handle: nobody else may connect
                return
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    pid, uid, _gid = peer_credentials(conn)
                except OSError as e:
                    log.warning("rank %d: memory handle server: no credentials for a connection: %s", self.owner, e)
                    continue
                if not self._known.wait(self.wait_s):
                    log.warning(
                        "rank %d: memory handle server: the ranks' process ids never arrived; refused pid %d",
                        self.owner,
                        pid,
                    )
                    continue
                if self._closed:
                    return
                refusal = self._refusal(pid, uid)
                if refusal:
                    log.warning(
                        "rank %d: memory handle server refused pid %d (uid %d): %s", self.owner, pid, uid, refusal
                    )
                    continue
                try:
                    socket.send_fds(conn, [b"f"], [self.fd])
                except OSError as e:
                    log.warning("rank %d: could not send the memory handle to pid %d: %s", self.owner, pid, e)
                    continue
                self._served.add(pid)

    def _refusal(self, pid: int, uid: int) -> str | None:
        assert self._expected is not None
        if uid != os.geteuid():
            return f"another user (this job runs as uid {os.geteuid()})"
        if pid in self._served:
            return "that rank already received its handle"
        if pid not in self._expected:
            return f"not a rank of this group (ranks' pids: {sorted(self._expected)})"
        return None

    def _close_socket(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def close(self) -> None:
        self._close_socket()
        self._known.set()  # a connection waiting for the pids gives up now
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


def _receive_fd(address: str, owner: int, owner_pid: int | None = None) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        try:
            s.connect(address)
            pid, uid, _ = peer_credentials(s)
            if uid != os.geteuid() or (owner_pid is not None and pid != owner_pid):
                raise BackendError(
                    f"the socket named in rank {owner}'s handle belongs to pid {pid} (uid {uid}), not to rank "
                    f"{owner} (pid {owner_pid}, uid {os.geteuid()}): refusing it"
                )
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
        except OSError as e:
            raise BackendError(f"could not receive rank {owner}'s memory handle over a Unix socket: {e}") from e
    if not fds:
        raise BackendError(
            f"rank {owner} sent no memory handle (its server refused this process: see the 'symmsync' log on rank "
            f"{owner})"
        )
    return fds[0]


#: Releases whose last tensor died while a CUDA graph was being captured (synchronizing
#: then would break the capture): done by the backend's next allocate or release.
_deferred: list[functools.partial] = []


def _flush_deferred() -> None:
    while _deferred and not torch.cuda.is_current_stream_capturing():
        _deferred.pop()()


def _unmap_when_unused(drv: Any, device: torch.device, ptr: int, state: dict) -> None:
    """Unmap (and, for own memory, free) one mapping: runs once, after its last tensor is gone."""
    kind = state.get("kind")
    if kind in (None, "released"):
        return
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        capturing = False
    if capturing:
        _deferred.append(functools.partial(_unmap_when_unused, drv, device, ptr, state))
        return
    state["kind"] = "released"
    try:
        torch.cuda.synchronize(device)  # no kernel may still touch the mapping
    except RuntimeError:
        pass  # a trapped kernel: the context is gone, unmapping below still tidies up
    try:
        if kind == "vmm-own":
            drv.cuMemUnmap(ptr, state["size"])
            drv.cuMemAddressFree(ptr, state["size"])
            drv.cuMemRelease(state["handle"])
        elif kind == "vmm-peer":
            drv.cuMemUnmap(ptr, state["size"])
            drv.cuMemAddressFree(ptr, state["size"])
        elif kind == "ipc-own":
            drv.cuMemFree(ptr)
        elif kind == "ipc-peer":
            drv.cuIpcCloseMemHandle(state["opened"] if "opened" in state else ptr)
        elif kind == "reservation":
            for chunk in state["chunks"]:
                _release_chunk(drv, chunk)
            _warn_if_failed(drv, drv.cuMemAddressFree(state["base"], state["size"]), "cuMemAddressFree")
    except Exception as e:  # noqa: BLE001 - runs from a finalizer: report, never raise
        log.warning("could not release %s memory at 0x%x: %s", kind, ptr, e)


def _release_chunk(drv: Any, chunk: Chunk) -> None:
    """Unmap one chunk of a reservation (at the address it was mapped at); release its
    physical memory if this rank created it."""
    st = chunk.state
    if st.get("released"):
        return
    st["released"] = True
    _warn_if_failed(drv, drv.cuMemUnmap(st["at"], chunk.nbytes), "cuMemUnmap")
    if st.get("handle") is not None:
        _warn_if_failed(drv, drv.cuMemRelease(st["handle"]), "cuMemRelease")
    _close_exchange(st)


def _warn_if_failed(drv: Any, result: Any, what: str) -> None:
    """Log a failed release (it runs where nothing may raise: finalizers, error paths)."""
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        log.warning("%s failed: %s", what, err)


def _close_exchange(state: dict) -> None:
    """Close what only served an exchange of handles: the descriptor server and the descriptor."""
    server = state.pop("server", None)
    if server is not None:
        server.close()
    fd = state.pop("fd", None)
    if fd is not None:
        os.close(fd)


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
            self._map_at(int(ptr), size, handle)
        except BackendError:
            drv.cuMemAddressFree(ptr, size)
            raise
        return int(ptr)

    def _unmap(self, ptr: int, size: int) -> None:
        self.drv.cuMemUnmap(ptr, size)
        self.drv.cuMemAddressFree(ptr, size)

    def _tensor(self, ptr: int, nbytes: int, state: dict) -> torch.Tensor:
        """The mapping's tensor; it owns the mapping (released after its last view is gone).

        The finalizer holds the driver, the address and the state, never the tensor or
        its Memory (that would keep the tensor alive forever).
        """
        release = functools.partial(_unmap_when_unused, self.drv, self.device, ptr, state)
        return tensor_at(ptr, nbytes, self.device, on_last_use=release)

    # ------------------------------------------------------------------ interface
    def allocate(self, nbytes: int, rank: int) -> Memory:
        _flush_deferred()
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
        return Memory(ptr=ptr, nbytes=nbytes, tensor=self._tensor(ptr, nbytes, state), owner=rank, state=state)

    def export_handle(self, mem: Memory) -> Any:
        drv = self.drv
        st = mem.state
        if self.handle_type == "cuda_ipc":
            h = check(drv.cuIpcGetMemHandle(mem.ptr), "cuIpcGetMemHandle")
            return ("cuda_ipc", bytes(h.reserved), mem.nbytes)
        return self._export_chunk(st["handle"], st["size"], mem.owner, st, nbytes=mem.nbytes)

    def exchanged(self, mem: Memory, handles: list[Any]) -> None:
        server = mem.state.get("server")
        if server is not None:
            server.expect(h[4] for h in handles if h is not None and h[0] == "posix_fd")

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
            state = {"kind": "ipc-peer"}
            return Memory(ptr=ptr, nbytes=nbytes, tensor=self._tensor(ptr, nbytes, state), owner=owner, state=state)
        size, nbytes = handle[2], handle[3]
        phys = self._import_phys(handle, owner)
        try:
            ptr = self._map(phys, size)
        finally:
            drv.cuMemRelease(phys)  # the mapping holds the memory from here on
        state = {"kind": "vmm-peer", "size": size}
        return Memory(ptr=ptr, nbytes=nbytes, tensor=self._tensor(ptr, nbytes, state), owner=owner, state=state)

    def all_mapped(self, mem: Memory) -> None:
        _close_exchange(mem.state)

    def release(self, mem: Memory) -> None:
        """Close the handle servers and drop symmsync's tensor over ``mem``.

        The mapping itself goes with the last tensor over it (:meth:`_tensor`): at once
        when nobody else holds one, else when the user's last tensor is gone.
        """
        self.all_mapped(mem)
        for chunk in (mem.state or {}).get("chunks", ()):
            self.chunk_all_mapped(chunk)
        mem.tensor = None  # type: ignore[assignment]
        _flush_deferred()

    # ------------------------------------------------------------ growable memory
    def _need_vmm(self, what: str) -> None:
        if self.handle_type == "cuda_ipc":
            raise BackendError(f"{what} needs the driver's virtual-memory management; handle_type='cuda_ipc' has none")

    def reserve(self, nbytes: int, owner: int) -> Memory:
        self._need_vmm("a growable buffer")
        _flush_deferred()
        size = self._round(nbytes)
        ptr = int(check(self.drv.cuMemAddressReserve(size, self.granularity, 0, 0), "cuMemAddressReserve"))
        state: dict[str, Any] = {"kind": "reservation", "base": ptr, "size": size, "chunks": []}
        return Memory(ptr=ptr, nbytes=size, tensor=self._tensor(ptr, size, state), owner=owner, state=state)

    def _map_at(self, at: int, size: int, phys: Any) -> None:
        drv = self.drv
        check(drv.cuMemMap(at, size, 0, phys, 0), "cuMemMap")
        try:
            check(drv.cuMemSetAccess(at, size, [self.access], 1), "cuMemSetAccess")
        except BackendError:
            drv.cuMemUnmap(at, size)
            raise

    def _in_reservation(self, mem: Memory, offset: int, nbytes: int) -> int:
        st = mem.state
        at = mem.ptr + offset
        if not (st["base"] <= at and at + nbytes <= st["base"] + st["size"]):
            raise BackendError(
                f"bytes [{offset}, {offset + nbytes}) of rank {mem.owner}'s memory lie outside the "
                f"{st['size']} bytes of address space reserved for it"
            )
        return at

    def _export_chunk(self, handle: Any, size: int, owner: int, state: dict, nbytes: int | None = None) -> tuple:
        """The handle peers map ``size`` bytes of physical memory with (``nbytes`` of them
        used): fabric bytes, or the address of a descriptor server kept in ``state``."""
        nbytes = size if nbytes is None else nbytes
        shareable = check(
            self.drv.cuMemExportToShareableHandle(handle, self.cu_handle_type, 0),
            f"cuMemExportToShareableHandle({self.handle_type})",
        )
        if self.handle_type == "fabric":
            return ("fabric", bytes(shareable.data), size, nbytes)
        state["fd"] = int(shareable)
        state["server"] = _FdServer(state["fd"], owner=owner)
        return ("posix_fd", state["server"].address, size, nbytes, os.getpid())

    def _import_phys(self, handle: Any, owner: int) -> Any:
        drv = self.drv
        if handle[0] == "posix_fd":
            fd = _receive_fd(handle[1], owner, handle[4])
            try:
                return check(
                    drv.cuMemImportFromShareableHandle(fd, self.cu_handle_type),
                    f"cuMemImportFromShareableHandle(rank {owner})",
                )
            finally:
                os.close(fd)
        fh = drv.CUmemFabricHandle()
        fh.data = handle[1]
        return check(
            drv.cuMemImportFromShareableHandle(fh, self.cu_handle_type),
            f"cuMemImportFromShareableHandle(fabric, rank {owner})",
        )

    def commit(self, mem: Memory, offset: int, nbytes: int) -> Chunk:
        drv = self.drv
        at = self._in_reservation(mem, offset, nbytes)
        phys = check(drv.cuMemCreate(nbytes, self.prop, 0), f"cuMemCreate({nbytes} bytes)")
        state: dict[str, Any] = {"handle": phys, "at": at}
        chunk = Chunk(offset=offset, nbytes=nbytes, state=state)
        try:
            self._map_at(at, nbytes, phys)
        except BackendError:
            drv.cuMemRelease(phys)
            raise
        mem.state["chunks"].append(chunk)
        try:
            check(drv.cuMemsetD8(at, 0, nbytes), "cuMemsetD8")
            check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            chunk.handle = self._export_chunk(phys, nbytes, mem.owner, state)
        except Exception as e:  # an OSError from the descriptor server too: nothing may stay mapped
            self.unmap_chunk(mem, chunk)
            raise e if isinstance(e, BackendError) else BackendError(f"exporting a chunk failed: {e}") from e
        return chunk

    def map_chunk(self, mem: Memory, offset: int, handle: Any) -> Chunk:
        size = handle[2]
        at = self._in_reservation(mem, offset, size)
        phys = self._import_phys(handle, mem.owner)
        try:
            self._map_at(at, size, phys)
        finally:
            self.drv.cuMemRelease(phys)  # the mapping holds the memory from here on
        chunk = Chunk(offset=offset, nbytes=size, state={"at": at})
        mem.state["chunks"].append(chunk)
        return chunk

    def unmap_chunk(self, mem: Memory, chunk: Chunk) -> None:
        try:
            torch.cuda.synchronize(self.device)  # no kernel may still touch it
        except RuntimeError:
            pass
        _release_chunk(self.drv, chunk)
        if chunk in mem.state["chunks"]:
            mem.state["chunks"].remove(chunk)

    def chunk_exchanged(self, chunk: Chunk, pids: list[int]) -> None:
        server = chunk.state.get("server")
        if server is not None:
            server.expect(pids)

    def chunk_all_mapped(self, chunk: Chunk) -> None:
        _close_exchange(chunk.state)

    # ------------------------------------------------------------ registered memory
    def _pieces(self, ptr: int, nbytes: int) -> list[tuple[int, int, Any]]:
        """``(base, size, retained handle)`` of every VMM allocation mapped over
        ``[ptr, ptr + nbytes)``, or ``[]`` when the memory is not VMM memory."""
        drv = self.drv
        pieces: list[tuple[int, int, Any]] = []
        at, end = ptr, ptr + nbytes
        while at < end:
            err, handle = drv.cuMemRetainAllocationHandle(at)
            if err != drv.CUresult.CUDA_SUCCESS:
                if not pieces:
                    return []  # not VMM memory: the caller tries CUDA IPC
                for _, _, h in pieces:
                    drv.cuMemRelease(h)
                raise BackendError(
                    f"the registered memory is not mapped at {at:#x} ({at - ptr} bytes in): "
                    f"cuMemRetainAllocationHandle gave {err}; register only what the runtime committed"
                )
            base, size = check(drv.cuMemGetAddressRange(at), "cuMemGetAddressRange")
            pieces.append((int(base), int(size), handle))
            at = int(base) + int(size)
        return pieces

    def export_local(self, ptr: int, nbytes: int, owner: int, known: int = 0) -> tuple[list[Any], Any]:
        _flush_deferred()
        drv = self.drv
        if self.handle_type != "cuda_ipc":
            pieces = self._pieces(ptr, nbytes)
        else:
            pieces = []
        # Every retained handle is in the state before any export, so a failure releases all.
        state: dict[str, Any] = {"chunks": [{"retained": h} for _, _, h in pieces], "end": known}
        if pieces:
            handles = []
            try:
                for (base, size, h), st in zip(pieces, state["chunks"]):
                    state["end"] = max(state["end"], base + size - ptr)
                    if base + size - ptr <= known:
                        continue  # peers mapped this chunk at an earlier call (known ends a chunk)
                    handles.append((base - ptr, self._export_chunk(h, size, owner, st)))
            except Exception as e:  # an OSError from a descriptor server too
                self.forget_local(state)
                raise BackendError(
                    f"{e}: the runtime's allocation cannot be exported as {self.handle_type!r}; create it with "
                    "that handle type in CUmemAllocationProp.requestedHandleTypes"
                ) from e
            return handles, state
        # A plain device allocation (torch's caching allocator, cudaMalloc): CUDA IPC.
        base, size = check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        base, size = int(base), int(size)
        if ptr + nbytes > base + size:
            raise BackendError(
                f"the registered range [{ptr:#x}, {ptr + nbytes:#x}) leaves its device allocation "
                f"[{base:#x}, {base + size:#x}); memory shared through CUDA IPC cannot grow past its allocation"
            )
        state["end"] = base + size - ptr
        if known:
            return [], state  # within the allocation peers opened already
        h = check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        return [("cuda_ipc", bytes(h.reserved), ptr - base, size)], state

    def local_exchanged(self, state: Any, pids: list[int]) -> None:
        for st in state["chunks"]:
            if st.get("server") is not None:
                st["server"].expect(pids)

    def forget_local(self, state: Any) -> None:
        for st in state["chunks"]:
            _close_exchange(st)
            h = st.pop("retained", None)
            if h is not None:
                self.drv.cuMemRelease(h)

    def import_local(self, handles: list[Any], owner: int, nbytes: int) -> Memory:
        if not handles:
            raise BackendError(f"rank {owner} registered no memory")
        if handles[0][0] == "cuda_ipc":
            _, raw, delta, size = handles[0]
            h = self.drv.CUipcMemHandle()
            h.reserved = raw
            opened = int(
                check(
                    self.drv.cuIpcOpenMemHandle(h, self.drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                    f"cuIpcOpenMemHandle(rank {owner})",
                )
            )
            ptr = opened + delta
            state = {"kind": "ipc-peer", "opened": opened}
            view = min(nbytes, size - delta)
            return Memory(ptr=ptr, nbytes=view, tensor=self._tensor(ptr, view, state), owner=owner, state=state)
        delta = -min(off for off, _ in handles)  # the registered address may start inside a chunk
        largest = max(h[2] for _, h in handles)
        size = self._round(delta + nbytes + largest)  # room for a last chunk past max_nbytes
        base = int(check(self.drv.cuMemAddressReserve(size, self.granularity, 0, 0), "cuMemAddressReserve"))
        state: dict[str, Any] = {"kind": "reservation", "base": base, "size": size, "chunks": []}
        ptr = base + delta
        mem = Memory(ptr=ptr, nbytes=nbytes, tensor=self._tensor(ptr, nbytes, state), owner=owner, state=state)
        self.extend_local(mem, handles)
        return mem
