"""The direct-KV writer over a runtime's own memory (registered, growing), on the host backend (and
on CUDA where it runs): the writer's bytes in a registered cache before and after a grow, against
the plain-torch reference (tests/oracles.py); cache tensors that differ across ranks or lie outside
symmetric memory are refused on every rank. The buffer's own growth and registration are
tests/core/test_runtime_memory.py's.
"""

import os

import oracles
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import pcp
from symmsync.testing import run
from symmsync.tools.runtime_alloc import HostCacheAllocator, block_major_caches, cache_allocator

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm and /proc/self/maps")

KIB = 1024


# ------------------------------------------------------------------ the writer on a runtime's cache
def _oracle(kv, pe, ix, slots, num_blocks, bs, layer):
    """The reference bytes of one layer: plain torch, from the format rules (tests/oracles.py)."""
    scale = [(t.float() * (layer + 1)).to(torch.bfloat16) for t in (kv, pe, ix)]
    return oracles.oracle_cache(pcp.CacheLayout(num_blocks, 1, bs), *scale, slots)


def runtime_cache_writer(backend, fused):
    """A runtime's growable block-major cache, registered; the writer publishes into blocks
    committed before and after a grow; each rank checks its own replica, read through the
    runtime's own tensors, against the reference bytes, and the padding against guards."""
    me = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    layers, bs = 2, 64
    max_blocks = 64 if backend == "cuda" else 8  # several of the allocator's chunks (2 MiB on GPUs)
    probe = block_major_caches(torch.empty(1 << 30, dtype=torch.uint8, device="meta"), layers, 1, bs)[2]
    rt = cache_allocator(max_blocks * probe, device, chunk=None if backend == "cuda" else 4096)
    chunk = rt.chunk
    per_block = -(-probe // chunk) * chunk  # commit whole chunks
    rt.commit(-(-4 * probe // chunk))  # 4 blocks' worth, rounded up to chunks
    main, ind, block_bytes = block_major_caches(rt.reserved(), layers, max_blocks, bs)
    assert block_bytes == probe and per_block >= probe
    buf = ss.SymmetricBuffer.register(rt.base, rt.committed, max_nbytes=rt.max_bytes, device=device)
    caches = pcp.CacheTensors(main, ind)
    writer = pcp.DirectKVWriter(ss.pcp_view(buf), caches, fused=fused, timeout_s=60)
    usable = writer._usable_blocks()
    for t in ind:  # the runtime's padding after each block's indexer bytes (new memory reads as zero)
        t[:usable, bs * 132 :].fill_(oracles.GUARD)
    num_slots = max_blocks * bs
    tokens = 96
    kv, pe, ix, _ = oracles.prompt(11, tokens, num_slots)
    split = pcp.pcp_split(tokens, 2)
    local = [split.local_rows(t, me).contiguous().to(device) for t in (kv, pe, ix)]
    g = torch.Generator().manual_seed(3)
    old = torch.randperm(usable * bs, generator=g)[:tokens]  # blocks committed at registration
    new = usable * bs + torch.randperm((max_blocks - usable) * bs, generator=g)[:tokens]  # blocks after the grow
    try:
        writer.prepare(split.local_slots(new, me).to(device))
        early = None
    except ss.InputError as e:
        early = str(e)
    rt.commit(rt.max_bytes // chunk - rt.committed // chunk)  # the runtime grows its cache
    buf.grow(rt.committed)
    for t in ind:
        t[usable:, bs * 132 :].fill_(oracles.GUARD)
    for slots in (old, new):
        batch = writer.prepare(split.local_slots(slots, me).to(device))
        for layer in range(layers):
            writer.write(layer, *[(t.float() * (layer + 1)).to(torch.bfloat16) for t in local], batch)
    writer.fence.fence()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ok = []
    both = torch.cat([old, new])
    kv2, pe2, ix2 = (torch.cat([t, t]) for t in (kv, pe, ix))
    for layer in range(layers):
        want_main, want_ind = _oracle(kv2, pe2, ix2, both, max_blocks, bs, layer)
        got_main, got_ind = main[layer].cpu(), ind[layer].cpu()
        ok.append(
            (
                torch.equal(got_main, want_main),
                torch.equal(got_ind[:, : bs * 132], want_ind),
                bool((got_ind[:, bs * 132 :] == oracles.GUARD).all()),  # the runtime's padding
            )
        )
    buf.close()
    dist.barrier()
    rt.free()
    return usable, early, ok


@pytest.mark.parametrize("fused", [False, True])
def test_the_writer_publishes_into_a_runtimes_registered_cache_before_and_after_it_grows(backend, fused, host_ranks):
    if backend == "host":
        results = host_ranks(runtime_cache_writer, 2, backend, fused)
    else:
        results = run(runtime_cache_writer, 2, backend, fused, backend=backend)
    for usable, early, ok in results:
        assert 0 < usable < (64 if backend == "cuda" else 8)
        assert early is not None and "grow the buffer first" in early
        assert ok == [(True, True, True)] * 2


def cache_tensors_that_disagree(case):
    me = dist.get_rank()
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB)
    rt.commit(16)
    buf = ss.SymmetricBuffer.register(rt.base, rt.committed, device="cpu")
    main, ind, _ = block_major_caches(rt.reserved(), 1, 4, 64)
    if case == "offsets" and me == 1:  # rank 1 holds its cache one block later
        main, ind, _ = block_major_caches(rt.reserved()[100992:], 1, 4, 64)
    if case == "outside" and me == 1:  # rank 1's indexer is not in symmetric memory
        ind = [torch.zeros(4, 64 * 132, dtype=torch.uint8)]
    try:
        pcp.DirectKVWriter(ss.pcp_view(buf), pcp.CacheTensors(main, ind), timeout_s=30)
        got = None
    except ss.ConfigError as e:
        got = (type(e).__name__, str(e))
    buf.close()
    dist.barrier()
    rt.free()
    return got


@pytest.mark.parametrize("case", ["offsets", "outside"])
def test_cache_tensors_at_different_offsets_or_outside_symmetric_memory_raise_on_every_rank(case, host_ranks):
    for got in host_ranks(cache_tensors_that_disagree, 2, case):
        assert got is not None
        if case == "offsets":
            assert got[0] == "ConfigError" and "differs across ranks" in got[1]
        else:
            assert got[0] == "BoundsError" and "rank 1" in got[1] and "outside symmetric memory" in got[1]
