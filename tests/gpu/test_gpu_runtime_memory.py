"""Growable buffers and runtime-registered memory on 2 GPUs.

A runtime-like allocator (symmsync/tools/runtime_alloc.py: reserve, commit chunks with a POSIX
file-descriptor handle type, map) and torch's own allocators, the default one (CUDA
IPC) and ``expandable_segments:True`` (VMM chunks). Oracles: bytes stamped by the
peer, read back by the owner through its own address; address tables before and
after a grow; the device's free memory before and after many cycles.
"""

import pytest
import torch
import torch.distributed as dist
from helpers import grow_with_a_planted_failure

import symmsync as ss
from symmsync.testing import run
from symmsync.tools.runtime_alloc import CudaCacheAllocator

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def _graph(fn):
    """``fn`` captured in a CUDA graph (after a warm-up run on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def growable_graph_then_grow():
    buf = ss.SymmetricBuffer(4 * MIB, backend="cuda", max_nbytes=64 * MIB)
    me, peer = buf.rank, 1 - buf.rank
    fence = ss.Fence(buf.view([0, 1]))
    ptrs = buf.ptrs.tolist()
    old = buf.tensor(0, (1024,), torch.int32, rank=peer)
    step = torch.zeros((), dtype=torch.int32, device=buf.device)

    def publish():
        old.copy_(step.expand(1024) + 1000 * (me + 1))
        fence.fence()

    g = _graph(publish)  # captured before the grow
    buf.grow(48 * MIB)
    new = buf.tensor(40 * MIB, (1024,), torch.int32, rank=peer)
    seen = []
    for i in range(3):
        step.fill_(i)
        g.replay()
        new.fill_(i + 7000 * (me + 1))
        fence.fence()
        torch.cuda.synchronize()
        seen.append(
            (
                buf.tensor(0, (1024,), torch.int32).unique().tolist(),
                buf.tensor(40 * MIB, (1024,), torch.int32).unique().tolist(),
            )
        )
        fence.fence()  # read before the peer's next replay overwrites it (a fence orders, it does not hold back)
    same = buf.ptrs.tolist() == ptrs
    buf.close()
    return seen, same


def test_a_graph_captured_before_a_grow_replays_after_it_and_new_memory_reaches_the_peer():
    for rank, (seen, same) in enumerate(run(growable_graph_then_grow, 2, backend="cuda")):
        peer = 1 - rank
        assert same
        assert seen == [([i + 1000 * (peer + 1)], [i + 7000 * (peer + 1)]) for i in range(3)]


def register_runtime_cache():
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    rt = CudaCacheAllocator(64 * MIB)
    rt.commit(2)
    rt.tensor(0, 2 * rt.chunk).fill_(0x5A)  # the runtime's bytes
    torch.cuda.synchronize()
    buf = ss.SymmetricBuffer.register(rt.base, 2 * rt.chunk, max_nbytes=rt.max_bytes, device=rt.device)
    untouched = int((rt.tensor(0, 2 * rt.chunk) == 0x5A).sum())
    fence = ss.Fence(buf.view([0, 1]))
    layer = rt.tensor(rt.chunk, 1024, torch.int32)  # a runtime tensor in its second chunk
    off = buf.offset_of(layer)
    dst = buf.tensor(off, (1024,), torch.int32, rank=peer)
    step = torch.zeros((), dtype=torch.int32, device=rt.device)

    def publish():
        dst.copy_(step.expand(1024) + 100 * (me + 1))
        fence.fence()

    g = _graph(publish)  # captured before the runtime grows its cache
    rt.commit(3)
    buf.grow(5 * rt.chunk)
    late = buf.tensor(4 * rt.chunk + 4096, (256,), torch.int32, rank=peer)
    seen = []
    for i in range(3):
        step.fill_(i)
        g.replay()
        late.fill_(i + 900 * (me + 1))
        fence.fence()
        torch.cuda.synchronize()
        mine = rt.tensor(4 * rt.chunk + 4096, 256, torch.int32)  # read through the runtime's own address
        seen.append((layer.unique().tolist(), mine.unique().tolist()))
        fence.fence()  # read before the peer's next replay overwrites it
    buf.close()
    dist.barrier()  # every peer unmapped before any owner frees: the teardown order
    rt.free()
    return untouched, off, seen


def test_runtime_vmm_memory_registers_grows_and_replays_a_graph_captured_before_the_grow():
    for rank, (untouched, off, seen) in enumerate(run(register_runtime_cache, 2, backend="cuda")):
        peer = 1 - rank
        assert untouched > 0 and off > 0
        assert seen == [([i + 100 * (peer + 1)], [i + 900 * (peer + 1)]) for i in range(3)]


def register_torch_tensor(nbytes):
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    cache = torch.zeros(nbytes // 4, dtype=torch.int32, device="cuda")  # torch's allocator owns it
    buf = ss.SymmetricBuffer.register(cache)
    fence = ss.Fence(buf.view([0, 1]))
    buf.tensor(nbytes - 4096, (1024,), torch.int32, rank=peer).fill_(55 + me)
    fence.fence()
    torch.cuda.synchronize()
    got = cache[-1024:].unique().tolist()
    buf.close()
    dist.barrier()
    return got


@pytest.mark.parametrize("alloc_conf", ["default", "expandable_segments:True"])
def test_torch_allocator_memory_registers(alloc_conf):
    env = {} if alloc_conf == "default" else {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    for rank, got in enumerate(run(register_torch_tensor, 2, 64 * MIB, backend="cuda", env=env)):
        assert got == [55 + 1 - rank]


def grow_fails_on_one_rank():
    buf = ss.SymmetricBuffer(4 * MIB, backend="cuda", max_nbytes=64 * MIB)
    me, peer = buf.rank, 1 - buf.rank
    msg = grow_with_a_planted_failure(buf, 32 * MIB)
    size = buf.nbytes
    buf.grow(32 * MIB)
    buf.tensor(20 * MIB, (16,), torch.int32, rank=peer).fill_(3 + me)
    torch.cuda.synchronize()
    dist.barrier()
    got = buf.tensor(20 * MIB, (16,), torch.int32).unique().tolist()
    buf.close()
    return msg, size, got


def test_a_grow_that_fails_on_one_rank_raises_everywhere_and_a_retry_works():
    for rank, (msg, size, got) in enumerate(run(grow_fails_on_one_rank, 2, backend="cuda")):
        assert msg is not None and "rank 1" in msg and "planted failure" in msg
        assert size == 4 * MIB and got == [3 + 1 - rank]


def register_grow_close_cycles(n):
    """Each cycle: a runtime allocates, registers from inside its first page (so peers map
    from a chunk's middle), grows, closes, and frees once every peer unmapped. A peer
    mapping left behind would keep the freed chunks allocated: free memory would fall."""
    free = []
    for i in range(n):
        rt = CudaCacheAllocator(16 * MIB)
        rt.commit(1)
        inside = 4096
        buf = ss.SymmetricBuffer.register(
            rt.base + inside, rt.chunk - inside, max_nbytes=rt.max_bytes - inside, device=rt.device
        )
        rt.commit(1)
        buf.grow(2 * rt.chunk - inside)
        grown = ss.SymmetricBuffer(MIB, backend="cuda", max_nbytes=8 * MIB)
        grown.grow(6 * MIB)
        grown.close()
        buf.close()
        dist.barrier()  # every peer unmapped before any owner frees: the teardown order
        rt.free()
        if i in (0, n - 1):
            torch.cuda.synchronize()
            dist.barrier()  # every rank at the same point (ranks may share a device)
            free.append(torch.cuda.mem_get_info()[0])
            dist.barrier()
    return free


def test_register_grow_close_cycles_leave_device_memory_where_it_started():
    for first, last in run(register_grow_close_cycles, 2, 200, backend="cuda"):
        assert last >= first, f"{(first - last) / MIB:.1f} MiB of device memory did not come back"
