"""A stand-in for a serving runtime's KV-cache allocator, for tests and examples.

Runtimes do not let a library allocate their KV cache: their allocator reserves
address space once and commits memory into it as the cache grows, so base pointers
never move (also after a CUDA graph was captured over them). These two allocators do
the same, knowing nothing of symmsync's buffers, so that :meth:`symmsync.SymmetricBuffer.register`
can be shown and tested on memory symmsync did not allocate:

* :class:`CudaCacheAllocator`: ``cuMemAddressReserve``, then chunks made with
  ``cuMemCreate`` (POSIX file-descriptor handle type), ``cuMemMap`` and ``cuMemSetAccess``.
* :class:`HostCacheAllocator`: an ``mmap`` reservation, then POSIX shared-memory
  objects (named, so peers can open them) mapped into it with ``MAP_FIXED``.

:func:`cache_allocator` picks one for a device.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import secrets

import torch

from ..backends.driver import check, driver

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.shm_unlink.argtypes = (ctypes.c_char_p,)
MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000


class HostCacheAllocator:
    """Reserve ``max_bytes`` of address space; :meth:`commit` maps ``chunk`` bytes more at the end.

    Each chunk is a shared-memory object of its own, or with ``one_object`` the one
    object grows (``ftruncate``) and each chunk maps its next bytes, so that the kernel
    may merge the mappings into one.
    """

    def __init__(self, max_bytes: int, chunk: int = 1 << 16, tag: str = "rt", one_object: bool = False):
        self.device = torch.device("cpu")
        self.chunk = chunk
        self.one_object = one_object
        self.max_bytes = -(-max_bytes // chunk) * chunk  # whole chunks
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        self.base = _libc.mmap(None, self.max_bytes, 0, flags, -1, 0)
        assert self.base not in (None, ctypes.c_void_p(-1).value)
        self.committed = 0
        self.names: list[str] = []
        self.tag = f"{os.environ.get('SYMMSYNC_SHM_PREFIX', 'symmsync')}-{tag}-{secrets.token_hex(4)}"

    def commit(self, chunks: int = 1) -> None:
        for _ in range(chunks):
            assert self.committed + self.chunk <= self.max_bytes, "the reservation is full"
            grow = self.one_object and self.names
            name = self.names[0] if grow else f"/{self.tag}-{len(self.names)}"
            flags = os.O_RDWR if grow else os.O_CREAT | os.O_EXCL | os.O_RDWR
            fd = os.open(f"/dev/shm{name}", flags, 0o600)
            at = self.committed if self.one_object else 0  # the object's bytes this chunk maps
            try:
                os.ftruncate(fd, at + self.chunk)
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                got = _libc.mmap(self.base + self.committed, self.chunk, prot, mmap.MAP_SHARED | MAP_FIXED, fd, at)
                assert got == self.base + self.committed
            finally:
                os.close(fd)
            if not grow:
                self.names.append(name)
            self.committed += self.chunk

    def tensor(self, offset: int, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The runtime's own view of ``n`` elements at byte ``offset``."""
        nbytes = n * dtype.itemsize
        assert offset + nbytes <= self.committed
        buf = (ctypes.c_uint8 * nbytes).from_address(self.base + offset)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)

    def reserved(self) -> torch.Tensor:
        """``uint8`` tensor over the whole reservation, committed or not (touch only what
        :attr:`committed` covers): what a runtime's tensors over a growable cache view."""
        buf = (ctypes.c_uint8 * self.max_bytes).from_address(self.base)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def free(self) -> None:
        """Unmap everything and remove the objects' names (the runtime's teardown)."""
        _libc.munmap(self.base, self.max_bytes)
        for name in self.names:
            _libc.shm_unlink(name.encode())
        self.names.clear()


class CudaCacheAllocator:
    """Reserve ``max_bytes`` on the current device; :meth:`commit` maps more chunks at the end."""

    def __init__(self, max_bytes: int, chunk: int | None = None):
        self.drv = drv = driver()
        self.device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(1, device=self.device)  # torch's context is current
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.prop = prop
        gran = check(
            drv.cuMemGetAllocationGranularity(
                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
            "granularity",
        )
        self.chunk = chunk or gran
        assert self.chunk % gran == 0
        self.max_bytes = (max_bytes + self.chunk - 1) // self.chunk * self.chunk
        self.base = int(check(drv.cuMemAddressReserve(self.max_bytes, self.chunk, 0, 0), "reserve"))
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        self.handles: list = []
        self.committed = 0

    def commit(self, chunks: int = 1) -> None:
        drv = self.drv
        for _ in range(chunks):
            assert self.committed + self.chunk <= self.max_bytes, "the reservation is full"
            h = check(drv.cuMemCreate(self.chunk, self.prop, 0), "cuMemCreate")
            at = self.base + self.committed
            check(drv.cuMemMap(at, self.chunk, 0, h, 0), "cuMemMap")
            check(drv.cuMemSetAccess(at, self.chunk, [self.access], 1), "cuMemSetAccess")
            check(drv.cuMemsetD8(at, 0, self.chunk), "cuMemsetD8")
            self.handles.append(h)
            self.committed += self.chunk
        torch.cuda.synchronize(self.device)

    def tensor(self, offset: int, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The runtime's own view of its bytes ``[offset, offset + n * itemsize)``."""
        nbytes = n * dtype.itemsize
        assert offset + nbytes <= self.committed
        storage = torch._C._construct_storage_from_data_pointer(self.base + offset, self.device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,)).view(dtype)

    def reserved(self) -> torch.Tensor:
        """``uint8`` tensor over the whole reservation, committed or not (touch only what
        :attr:`committed` covers): what a runtime's tensors over a growable cache view."""
        storage = torch._C._construct_storage_from_data_pointer(self.base, self.device, self.max_bytes)
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (self.max_bytes,), (1,))

    def free(self) -> None:
        """The runtime's teardown: unmap, release the chunks, free the address space."""
        drv = self.drv
        torch.cuda.synchronize(self.device)
        for i, h in enumerate(self.handles):
            drv.cuMemUnmap(self.base + i * self.chunk, self.chunk)
            drv.cuMemRelease(h)
        drv.cuMemAddressFree(self.base, self.max_bytes)
        self.handles.clear()
        self.committed = 0


def cache_allocator(max_bytes: int, device: torch.device | str, chunk: int | None = None):
    """A :class:`CudaCacheAllocator` for a CUDA device, else a :class:`HostCacheAllocator`."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return CudaCacheAllocator(max_bytes, chunk)
    return HostCacheAllocator(max_bytes, chunk or 1 << 16)


def block_major_caches(
    reserved: torch.Tensor, num_layers: int, num_blocks: int, block_size: int = 64, indexer_pad: int = 64
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Per-layer DeepSeek-V3.2 cache tensors laid out block by block, as a growable cache does.

    Block ``b`` holds every layer's main KV (``block_size * 656`` bytes each), then every
    layer's indexer K (``block_size * 132`` bytes padded by ``indexer_pad``), so committing
    memory from the start of the reservation adds whole blocks to every layer at once.

    Returns:
        ``(main, indexer, block_bytes)``: per layer a ``uint8 [num_blocks, block_size, 656]``
        and a ``uint8 [num_blocks, block_size * 132 + indexer_pad]`` view of ``reserved``
        (block stride ``block_bytes`` in both), and the bytes of one block of all layers.
    """
    from ..pcp.layout import IndexerKLayout, MainKVLayout  # the pcp package imports the core: import late

    token = MainKVLayout.TOKEN_BYTES
    main_bytes = block_size * token
    idx_bytes = block_size * IndexerKLayout.TOKEN_BYTES + indexer_pad
    block = num_layers * (main_bytes + idx_bytes)
    assert num_blocks * block <= reserved.numel(), "the reservation is too small for these blocks"
    at = reserved.storage_offset()  # as_strided counts from the storage, not from the view
    main = [
        reserved.as_strided((num_blocks, block_size, token), (block, token, 1), at + i * main_bytes)
        for i in range(num_layers)
    ]
    first_idx = at + num_layers * main_bytes
    indexer = [
        reserved.as_strided((num_blocks, idx_bytes), (block, 1), first_idx + i * idx_bytes) for i in range(num_layers)
    ]
    return main, indexer, block
