"""Growable buffers and runtime-registered memory, on the host backend (the CI twins
of the GPU tests in test_gpu_runtime_memory.py).

Oracles: bytes each rank stamped into its peers' memory, read back by the owner;
address tables compared before and after a grow; the process's own mapping table
(``/proc/self/maps``) for what stays mapped.
"""

import os

import pytest
import torch
import torch.distributed as dist
from helpers import grow_with_a_planted_failure

import symmsync as ss
from symmsync.testing import run
from symmsync.tools.runtime_alloc import HostCacheAllocator

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm and /proc/self/maps")

KIB = 1024


def _stamp(buf, offset, n, value, rank):
    buf.tensor(offset, (n,), torch.int32, rank=rank).fill_(value)


def grow_keeps_addresses_tensors_and_fences():
    buf = ss.SymmetricBuffer(8 * KIB, backend="host", max_nbytes=1 << 20)
    me, peer = buf.rank, 1 - buf.rank
    fence = ss.Fence(buf.view([0, 1]), timeout_s=60)
    ptrs, cells = buf.ptrs.tolist(), buf.cell_ptrs.data_ptr()
    early = buf.tensor(0, (16,), torch.int32, rank=peer)  # taken before the grow
    early.fill_(100 + me)
    fence.fence()
    buf.grow(600 * KIB)
    _stamp(buf, 500 * KIB, 16, 200 + me, peer)  # into memory that did not exist before
    early[8:].fill_(300 + me)  # the old tensor still reaches the peer
    fence.fence()
    seen = buf.tensor(0, (16,), torch.int32).tolist(), buf.tensor(500 * KIB, (16,), torch.int32).tolist()
    same_tables = buf.ptrs.tolist() == ptrs and buf.cell_ptrs.data_ptr() == cells
    buf.grow(600 * KIB)  # the same size: nothing to do
    result = seen, same_tables, buf.nbytes, fence.epoch
    buf.close()
    return result


def test_grow_maps_new_memory_on_every_peer_and_keeps_what_was_made_before(host_ranks):
    for rank, (seen, same_tables, nbytes, epoch) in enumerate(host_ranks(grow_keeps_addresses_tensors_and_fences, 2)):
        peer = 1 - rank
        assert seen[0] == [100 + peer] * 8 + [300 + peer] * 8
        assert seen[1] == [200 + peer] * 16
        assert same_tables and nbytes == 600 * KIB and epoch == 2


def bad_grows():
    buf = ss.SymmetricBuffer(8 * KIB, backend="host", max_nbytes=64 * KIB)
    errors = {}
    for name, n in {"past_max": 128 * KIB, "shrink": 4 * KIB, "differ": 16 * KIB if buf.rank else 32 * KIB}.items():
        try:
            buf.grow(n)
        except ss.SymmSyncError as e:
            errors[name] = (type(e).__name__, str(e))
    fixed = ss.SymmetricBuffer(8 * KIB, backend="host")
    try:
        fixed.grow(16 * KIB)
    except ss.ConfigError as e:
        errors["fixed"] = (type(e).__name__, str(e))
    result = errors, buf.nbytes
    buf.close()
    fixed.close()
    return result


def test_bad_grows_raise_on_every_rank_and_change_nothing(host_ranks):
    for errors, nbytes in host_ranks(bad_grows, 2):
        assert errors["past_max"][0] == "BoundsError" and "65536" in errors["past_max"][1]
        assert errors["shrink"][0] == "BoundsError"
        assert errors["differ"][0] == "SizeMismatchError" and "rank 0: 32768" in errors["differ"][1]
        assert "not growable" in errors["fixed"][1]
        assert nbytes == 8 * KIB


def _mapping_lines() -> int:
    """The lines of /proc/self/maps a grow could leave: all but anonymous private read-write
    memory (Python's and torch's heaps, which grow on their own: pymalloc maps 1 MiB arenas)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if not (line.split()[1] == "rw-p" and len(line.split()) == 5))


def planted_failure(failing_rank: int, step: str):
    buf = ss.SymmetricBuffer(8 * KIB, backend="host", max_nbytes=1 << 20)
    me, peer = buf.rank, 1 - buf.rank
    _stamp(buf, 0, 4, 7 + me, peer)
    dist.barrier()
    before = _mapping_lines()
    msg = grow_with_a_planted_failure(buf, 512 * KIB, step, failing_rank)
    after = _mapping_lines()
    kept = buf.nbytes, buf.tensor(0, (4,), torch.int32).tolist()
    try:
        buf.tensor(256 * KIB, (4,), torch.int32)
        beyond = "reachable"
    except ss.BoundsError:
        beyond = "refused"
    buf.grow(512 * KIB)  # a later grow works: nothing was left half-mapped
    _stamp(buf, 256 * KIB, 4, 40 + me, peer)
    dist.barrier()
    later = buf.tensor(256 * KIB, (4,), torch.int32).tolist()
    buf.close()
    return msg, before, after, kept, beyond, later


@pytest.mark.parametrize("step", ["commit", "map_chunk"])
def test_a_grow_that_fails_on_one_rank_raises_everywhere_and_keeps_the_old_size(step, host_ranks):
    for rank, (msg, before, after, kept, beyond, later) in enumerate(host_ranks(planted_failure, 2, 1, step)):
        assert msg is not None and "rank 1" in msg and "planted failure" in msg and "keeps its 8192 bytes" in msg
        assert after <= before  # nothing mapped by the failed grow stays mapped
        assert kept == (8 * KIB, [7 + 1 - rank] * 4) and beyond == "refused"
        assert later == [40 + 1 - rank] * 4


# ------------------------------------------------------------------ registered memory
def register_runtime_memory():
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB)
    rt.commit(2)
    mine = rt.tensor(0, 128 * KIB)
    mine.fill_(0x5A)  # the runtime's bytes: symmsync must not write any
    layer = rt.tensor(64 * KIB, 256)  # a runtime tensor at an offset it knows
    buf = ss.SymmetricBuffer.register(rt.base, 128 * KIB, max_nbytes=1 << 20, device="cpu")
    untouched = int((mine == 0x5A).sum())
    offset = buf.offset_of(layer)
    fence = ss.Fence(buf.view([0, 1]), timeout_s=60)
    buf.tensor(offset, (64,), torch.int32, rank=peer).fill_(1000 + me)
    fence.fence()
    got = layer.view(torch.int32)[:4].tolist()  # read by the runtime through its own address
    rt.commit(2)  # the runtime grows its cache
    buf.grow(256 * KIB)
    buf.tensor(200 * KIB, (8,), torch.int32, rank=peer).fill_(2000 + me)
    fence.fence()
    grown = rt.tensor(200 * KIB, 32).view(torch.int32).tolist()
    apart = buf.cell_ptrs.tolist() != buf.ptrs.tolist()
    buf.close()  # unmaps the peer here, releases nothing the runtime owns
    rt.tensor(0, 16).fill_(1)  # still the runtime's, still mapped
    after_close = rt.tensor(0, 16).tolist()
    dist.barrier()  # every rank closed before any runtime frees: the teardown order
    rt.free()
    return untouched, offset, got, grown, apart, after_close


def test_registered_runtime_memory_is_mapped_on_every_peer_and_grows(host_ranks):
    for rank, (untouched, offset, got, grown, apart, after_close) in enumerate(host_ranks(register_runtime_memory, 2)):
        peer = 1 - rank
        assert untouched == 128 * KIB  # registration wrote none of the runtime's bytes
        assert offset == 64 * KIB  # offsets count from the registered address
        assert got == [1000 + peer] * 4 and grown == [2000 + peer] * 8
        assert apart  # the cells live apart from the runtime's memory
        assert after_close == [1] * 16


def register_anonymous_memory(rank_with_bad_memory):
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB)
    rt.commit(1)
    plain = torch.zeros(64 * KIB, dtype=torch.uint8)  # private memory: no peer can open it
    local = plain if dist.get_rank() == rank_with_bad_memory else rt.tensor(0, 64 * KIB)
    try:
        ss.SymmetricBuffer.register(local)
        msg = None
    except ss.BackendError as e:
        msg = str(e)
    dist.barrier()
    rt.free()
    return msg


def test_registering_memory_peers_cannot_open_raises_on_every_rank(host_ranks):
    for msg in host_ranks(register_anonymous_memory, 2, 1):
        assert msg is not None and "rank 1" in msg and "shared-memory object" in msg


def register_cycles(n):
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB)
    rt.commit(1)
    start = None
    for i in range(n):
        buf = ss.SymmetricBuffer.register(rt.base, 64 * KIB, max_nbytes=256 * KIB, device="cpu")
        if i == 0:
            rt.commit(1)
        buf.grow(128 * KIB)
        buf.close()
        if i == 0:
            start = _mapping_lines()
    end = _mapping_lines()  # not the heaps' anonymous memory: pymalloc maps arenas on its own
    dist.barrier()
    rt.free()
    return start, end


def test_register_grow_close_cycles_leave_the_mappings_where_they_started():
    # Fresh processes (not host_ranks): a process that ran other tests may map more while this runs.
    for start, end in run(register_cycles, 2, 200):
        assert end <= start


def register_one_growing_object():
    """The runtime grows one shared-memory object, whose mappings the kernel merges; the
    registered size ends inside a chunk. The grow maps only what peers lacked."""
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB, one_object=True)
    rt.commit(2)
    buf = ss.SymmetricBuffer.register(rt.base, 100 * KIB, max_nbytes=1 << 20, device="cpu")
    rt.commit(3)
    buf.grow(300 * KIB)
    _stamp(buf, 90 * KIB, 4, 10 + me, peer)  # in the chunk both calls cover
    _stamp(buf, 290 * KIB, 4, 20 + me, peer)  # in memory committed after registration
    dist.barrier()
    got = rt.tensor(90 * KIB, 4, torch.int32).tolist(), rt.tensor(290 * KIB, 4, torch.int32).tolist()
    buf.close()
    dist.barrier()
    rt.free()
    return got


def test_a_runtime_object_that_grows_in_place_registers_and_grows(host_ranks):
    for rank, got in enumerate(host_ranks(register_one_growing_object, 2)):
        assert got == ([10 + 1 - rank] * 4, [20 + 1 - rank] * 4)


def register_inside_a_page():
    """A registered address that is not page aligned (a runtime's tensor starting inside
    a chunk): peers map whole pages and find the bytes at the same offsets."""
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB)
    rt.commit(2)
    buf = ss.SymmetricBuffer.register(rt.base + 256, 64 * KIB, max_nbytes=(1 << 20) - 256, device="cpu")
    _stamp(buf, 0, 4, 30 + me, peer)
    _stamp(buf, 64 * KIB - 16, 4, 40 + me, peer)  # past the first chunk
    dist.barrier()
    got = rt.tensor(256, 4, torch.int32).tolist(), rt.tensor(256 + 64 * KIB - 16, 4, torch.int32).tolist()
    buf.close()
    dist.barrier()
    rt.free()
    return got


def test_a_registered_address_inside_a_page_maps_at_the_same_offsets(host_ranks):
    for rank, got in enumerate(host_ranks(register_inside_a_page, 2)):
        assert got == ([30 + 1 - rank] * 4, [40 + 1 - rank] * 4)


def registered_grow_fails_on_one_rank():
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB)
    rt.commit(1)
    buf = ss.SymmetricBuffer.register(rt.base, 64 * KIB, max_nbytes=1 << 20, device="cpu")
    rt.commit(2)
    msg = grow_with_a_planted_failure(buf, 192 * KIB)
    size = buf.nbytes
    buf.grow(192 * KIB)  # the retry maps what the failed grow did not
    _stamp(buf, 150 * KIB, 4, 60 + me, peer)
    dist.barrier()
    got = rt.tensor(150 * KIB, 4, torch.int32).tolist()
    buf.close()
    try:
        buf.grow(256 * KIB)  # closed on this rank: the peer must not wait for it
        closed = None
    except ss.ClosedError as e:
        closed = str(e)
    dist.barrier()
    rt.free()
    return msg, size, got, closed


def test_a_registered_grow_that_fails_on_one_rank_raises_everywhere_and_a_retry_works(host_ranks):
    for rank, (msg, size, got, closed) in enumerate(host_ranks(registered_grow_fails_on_one_rank, 2)):
        assert msg is not None and msg.startswith("SymmetricBuffer.grow:") and "planted failure" in msg
        assert "keeps its 65536 bytes" in msg and size == 64 * KIB
        assert got == [60 + 1 - rank] * 4
        assert closed is not None and "used after close()" in closed
