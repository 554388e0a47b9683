"""Host backend: POSIX shared-memory segments, mapped by every process into reservations.

Every mapping lives in a reservation of address space (``mmap`` with ``PROT_NONE``): each
rank creates a segment per chunk, maps it into its own reservation, sends its name to the
group; every peer maps it at the same offset of its reservation of that rank's memory and,
once all ranks have mapped everything, the creator unlinks the name. From then on the
segments exist only as mappings, so a crash cannot leave anything in ``/dev/shm``. What of a
reservation is not mapped stays ``PROT_NONE``: a store there kills the process with ``SIGSEGV``.

Kernels that use this memory run under Triton's interpreter (``TRITON_INTERPRET=1``),
whose int32/int64 atomics are real lock-free atomics across processes; that is what
makes the host backend test real cross-process synchronization.
"""

from __future__ import annotations

import _posixshmem
import atexit
import ctypes
import ctypes.util
import functools
import mmap
import os
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import BackendError
from .base import INTERPRETER, Backend, Chunk, LocalExport, Memory, Piece, part_of, tensor_at

#: Prefix of segment names; ``symmsync.testing`` sets it per job so that it can
#: find (and remove) anything a killed rank left behind.
PREFIX_ENV = "SYMMSYNC_SHM_PREFIX"

_linked: set[str] = set()


class Segment(NamedTuple):
    """The handle of host memory: ``nbytes`` of the shared-memory object ``name`` from
    byte ``offset`` of it (``shm_open`` + ``mmap``)."""

    name: str
    nbytes: int
    offset: int = 0


@dataclass
class _Reservation:
    """Address space from ``base`` mapped ``PROT_NONE``, and the chunks mapped into it
    (within ``[base, base + size)``; a guard past ``size`` stays ``PROT_NONE``)."""

    base: int
    size: int
    chunks: list[Chunk] = field(default_factory=list)
    released: bool = False


@dataclass
class _ChunkName:
    """A chunk's segment name while this rank (its creator) still has it linked."""

    name: str | None = None


def _unlink(name: str) -> None:
    if name in _linked:
        _linked.discard(name)
        try:
            _posixshmem.shm_unlink(name)
        except FileNotFoundError:
            pass


@atexit.register
def _unlink_all() -> None:  # a rank that dies between create and seal still cleans up
    for name in list(_linked):
        _unlink(name)


def segment_prefix() -> str:
    """The name prefix of this process's segments (without the leading slash)."""
    return os.environ.get(PREFIX_ENV, "symmsync")


# Reservations: address space mapped PROT_NONE, into which shared-memory segments are
# mapped with MAP_FIXED. Python's mmap module cannot map at an address, so libc's mmap.
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FIXED = 0x10  # Linux and macOS; PROT_NONE is 0
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MAP_FAILED = ctypes.c_void_p(-1).value
_HOLE = (0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)


def _mmap(addr: int, nbytes: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    got = _libc.mmap(addr or None, nbytes, prot, flags, fd, offset)
    if got in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise BackendError(f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
    return got


def _unmap_reservation(base: int, nbytes: int, state: _Reservation) -> None:
    """Unmap a whole reservation and every chunk in it: once, after its last tensor is gone."""
    if not state.released:
        state.released = True
        _libc.munmap(base, nbytes)


def _page_floor(x: int) -> int:
    return x - x % mmap.PAGESIZE


def shm_mappings(ptr: int, nbytes: int) -> list[tuple[int, int, int, str]]:
    """The shared-memory mappings covering ``[ptr, ptr + nbytes)`` in this process, from
    ``/proc/self/maps``: ``(start, end, file offset, path)`` each, page aligned.

    Raises :class:`~symmsync.BackendError` where a page is not mapped from a
    shared-memory object that peers can open by name."""
    if not os.path.exists("/proc/self/maps"):
        raise BackendError("registering host memory reads /proc/self/maps, which this system does not have")
    lo, hi = _page_floor(ptr), ptr + nbytes
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if end <= lo or start >= hi:
                continue
            path = parts[5].strip() if len(parts) > 5 else ""
            if not path.startswith("/dev/shm/") or path.endswith("(deleted)") or "s" not in parts[1]:
                why = "anonymous or private" if not path else f"{path!r}, which peers cannot open by name"
                raise BackendError(
                    f"bytes [{max(start, lo):#x}, {min(end, hi):#x}) of the memory to register are mapped from {why}; "
                    "the host backend registers memory mapped (MAP_SHARED) from a POSIX shared-memory object "
                    "whose name still exists, so that peers can open it"
                )
            first = max(start, lo)
            found.append((first, min(end, hi + (-hi) % mmap.PAGESIZE), int(parts[2], 16) + first - start, path))
    found.sort()
    covered = lo
    for start, end, _, _ in found:
        if start > covered:
            break
        covered = max(covered, end)
    if covered < hi:
        raise BackendError(f"bytes from {covered:#x} of the memory to register (up to {hi:#x}) are not mapped")
    return found


def _new_segment(rank: int, nbytes: int, place: Any) -> tuple[str, Any]:
    """Create a zero-filled segment of ``nbytes`` named for this job and map it with
    ``place(fd)``; return its name (linked until every peer mapped it) and what ``place`` gave."""
    name = f"/{segment_prefix()}-{rank}-{secrets.token_hex(6)}"
    try:
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    except OSError as e:
        raise BackendError(f"rank {rank}: shm_open({name}) failed: {e}") from e
    _linked.add(name)
    try:
        os.ftruncate(fd, nbytes)  # new pages read as zero
        return name, place(fd)
    except (OSError, OverflowError, BackendError) as e:
        _unlink(name)
        raise BackendError(
            f"rank {rank}: could not size or map {nbytes} bytes of shared memory ({e}); is /dev/shm large enough?"
        ) from e
    finally:
        os.close(fd)


def _open_segment(name: str, owner: int, need: int, place: Any) -> Any:
    """Open rank ``owner``'s segment ``name``, check it holds ``need`` bytes, map it with
    ``place(fd)``; return what ``place`` gave."""
    try:
        fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    except OSError as e:
        raise BackendError(f"could not open rank {owner}'s segment {name}: {e}") from e
    try:
        size = os.fstat(fd).st_size
        if size < need:
            raise BackendError(f"rank {owner}'s segment {name} holds {size} bytes, expected {need}")
        return place(fd)
    finally:
        os.close(fd)


class HostBackend(Backend):
    """POSIX shared memory (``shm_open`` + ``mmap``); the device is the CPU."""

    name = "host"
    capabilities = INTERPRETER
    reserves = True

    def abandon(self, handle: Segment) -> None:
        # A peer killed before it unlinked its name would leave the segment in /dev/shm.
        try:
            _posixshmem.shm_unlink(handle.name)
        except OSError:
            pass  # already unlinked by its owner or another rank

    def release(self, mem: Memory) -> None:
        # Drop symmsync's tensor only: the reservation (and every segment mapped into it)
        # is unmapped when its last tensor is gone, at once when the user holds none.
        st = mem.state
        if isinstance(st, _Reservation):
            for chunk in st.chunks:
                if chunk.state.name:
                    _unlink(chunk.state.name)
        mem.tensor = None  # type: ignore[assignment]

    # ------------------------------------------------------------ growable and registered memory
    granularity = mmap.PAGESIZE

    def reserve(self, nbytes: int, owner: int) -> Memory:
        base = _mmap(0, nbytes, *_HOLE)
        state = _Reservation(base, nbytes)
        release = functools.partial(_unmap_reservation, base, nbytes, state)
        t = tensor_at(base, nbytes, self.device, on_last_use=release)
        return Memory(ptr=base, nbytes=nbytes, tensor=t, owner=owner, state=state)

    def _map_segment(self, mem: Memory, offset: int, nbytes: int, fd: int, file_offset: int = 0) -> None:
        base, size = mem.state.base, mem.state.size
        at = mem.ptr + offset
        if not (base <= at and at + nbytes <= base + size):
            raise BackendError(f"bytes [{offset}, {offset + nbytes}) lie outside the reservation of {size} bytes")
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        _mmap(at, nbytes, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, file_offset)

    def commit(self, mem: Memory, offset: int, nbytes: int) -> Chunk:
        name, _ = _new_segment(mem.owner, nbytes, lambda fd: self._map_segment(mem, offset, nbytes, fd))
        chunk = Chunk(offset=offset, nbytes=nbytes, handle=Segment(name, nbytes), state=_ChunkName(name))
        mem.state.chunks.append(chunk)
        return chunk

    def map_chunk(self, mem: Memory, offset: int, handle: Segment) -> Chunk:
        name, nbytes, file_offset = handle
        _open_segment(
            name, mem.owner, file_offset + nbytes, lambda fd: self._map_segment(mem, offset, nbytes, fd, file_offset)
        )
        chunk = Chunk(offset=offset, nbytes=nbytes, state=_ChunkName())
        mem.state.chunks.append(chunk)
        return chunk

    def unmap_chunk(self, mem: Memory, chunk: Chunk) -> None:
        _mmap(mem.ptr + chunk.offset, chunk.nbytes, *_HOLE[:1], _HOLE[1] | _MAP_FIXED)
        if chunk.state.name:
            _unlink(chunk.state.name)
        if chunk in mem.state.chunks:
            mem.state.chunks.remove(chunk)

    def chunk_all_mapped(self, chunk: Chunk) -> None:
        if chunk.state.name:
            _unlink(chunk.state.name)

    def export_local(self, ptr: int, nbytes: int, owner: int, known: int = 0) -> LocalExport:
        pieces = []
        last = ptr + known
        for start, end, file_offset, path in shm_mappings(ptr, nbytes):
            if end <= ptr + known:
                continue  # peers mapped it at an earlier call
            if known and start < ptr + known:  # the kernel may have merged a grown mapping with the old one
                file_offset += ptr + known - start
                start = ptr + known
            name = "/" + path[len("/dev/shm/") :]
            pieces.append(Piece(start - ptr, Segment(name, end - start, file_offset)))
            last = max(last, end)
        return LocalExport(pieces=pieces, end=last - ptr)  # nothing for forget_local: peers open by name

    def import_local(self, pieces: list[Piece], owner: int, nbytes: int, guard: int = 0) -> Memory:
        if not pieces:
            raise BackendError(f"rank {owner} registered no memory")
        delta = -min(p.offset for p in pieces)  # the page the owner's memory starts in
        size = delta + nbytes + (-(delta + nbytes)) % mmap.PAGESIZE
        res = self.reserve(size + guard, owner)
        res.state.size = size  # chunks map below it: the guard after it is never mapped
        tensor = part_of(res.tensor, delta, nbytes)  # a storage that spans no guard
        mem = Memory(ptr=res.ptr + delta, nbytes=nbytes, tensor=tensor, owner=owner, state=res.state)
        self.extend_local(mem, pieces)
        return mem
