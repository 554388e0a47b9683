"""Host backend: one POSIX shared-memory segment per rank, mapped by every process.

Each rank creates a segment, sends its name to the group, maps every peer's segment
and, once all ranks have mapped everything, unlinks its own name. From then on the
segments exist only as mappings, so a crash cannot leave anything in ``/dev/shm``.

Kernels that use this memory run under Triton's interpreter (``TRITON_INTERPRET=1``),
whose int32/int64 atomics are real lock-free atomics across processes; that is what
makes the host backend test real cross-process synchronization.
"""

from __future__ import annotations

import _posixshmem
import atexit
import mmap
import os
import secrets
import warnings

import torch

from ..errors import BackendError
from . import Backend, Memory

#: Prefix of segment names; ``symmsync.testing`` sets it per job so that it can
#: find (and remove) anything a killed rank left behind.
PREFIX_ENV = "SYMMSYNC_SHM_PREFIX"

_linked: set[str] = set()


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


def _as_tensor(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns on writable buffers; we want writes
        return torch.frombuffer(mm, dtype=torch.uint8)


class HostBackend(Backend):
    """POSIX shared memory (``shm_open`` + ``mmap``); the device is the CPU."""

    name = "host"

    def allocate(self, nbytes: int, rank: int) -> Memory:
        name = f"/{segment_prefix()}-{rank}-{secrets.token_hex(6)}"
        try:
            fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except OSError as e:
            raise BackendError(f"rank {rank}: shm_open({name}) failed: {e}") from e
        _linked.add(name)
        try:
            os.ftruncate(fd, nbytes)  # new pages read as zero
            mm = mmap.mmap(fd, nbytes)
        except (OSError, OverflowError) as e:
            _unlink(name)
            raise BackendError(
                f"rank {rank}: could not size or map {nbytes} bytes of shared memory ({e}); is /dev/shm large enough?"
            ) from e
        finally:
            os.close(fd)
        t = _as_tensor(mm)
        return Memory(ptr=t.data_ptr(), nbytes=nbytes, tensor=t, owner=rank, state={"name": name, "mmap": mm})

    def export_handle(self, mem: Memory) -> tuple[str, int]:
        return (mem.state["name"], mem.nbytes)

    def import_handle(self, handle: tuple[str, int], owner: int) -> Memory:
        name, nbytes = handle
        try:
            fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        except OSError as e:
            raise BackendError(f"could not open rank {owner}'s segment {name}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise BackendError(f"rank {owner}'s segment {name} holds {size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        t = _as_tensor(mm)
        return Memory(ptr=t.data_ptr(), nbytes=nbytes, tensor=t, owner=owner, state={"name": None, "mmap": mm})

    def all_mapped(self, mem: Memory) -> None:
        _unlink(mem.state["name"])

    def abandon(self, handle: tuple[str, int]) -> None:
        # A peer killed before it unlinked its name would leave the segment in /dev/shm.
        try:
            _posixshmem.shm_unlink(handle[0])
        except OSError:
            pass  # already unlinked by its owner or another rank

    def release(self, mem: Memory) -> None:
        name = mem.state.get("name")
        if name:
            _unlink(name)
        # Drop symmsync's references and never call mmap.close(): torch.frombuffer keeps
        # a reference to the mmap object but no buffer export, so close() would unmap
        # pages that a tensor the user still holds points to (a segfault on its next
        # access). Unreferenced, the mmap object unmaps when its last tensor is gone:
        # at once when there is none.
        mem.state.pop("mmap", None)
        mem.tensor = None  # type: ignore[assignment]
