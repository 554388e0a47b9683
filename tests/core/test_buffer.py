"""SymmetricBuffer: exchange, views of peer memory, bad input, teardown.

On the host backend everywhere; the tests that take the ``backend`` fixture also run on
the CUDA backend where the GPUs exist (marked ``gpu``).
"""

import glob
import os

import pytest
import torch
import torch.distributed as dist
from helpers import need_gpus

import symmsync as ss
from symmsync.testing import run

NBYTES = 64 * 1024


def _stamp(src: int, dst: int) -> int:
    return 1000 * src + dst + 1


def exchange_pattern(nbytes: int, backend: str = "host") -> list[list[int]]:
    """Every rank writes a rank-stamped block into every peer, then reads its own."""
    with ss.SymmetricBuffer(nbytes, backend=backend) as buf:
        r, w = buf.rank, buf.world_size
        device = torch.device("cpu") if backend == "host" else torch.device("cuda", torch.cuda.current_device())
        assert buf.backend == backend and buf.device == device and buf.nbytes == nbytes
        assert buf.ptrs.dtype == torch.int64 and buf.ptrs.shape == (w,) and buf.ptrs.device == device
        block = nbytes // w // 16 * 16 // 8  # int64 words per source rank
        for p in range(w):
            t = buf.tensor(r * block * 8, (block,), torch.int64, rank=p)
            assert t.device == buf.device  # peer memory as a tensor on this rank's device
            t.copy_(torch.arange(block, dtype=torch.int64, device=buf.device) * 7 + _stamp(r, p))
        if buf.capabilities.streams:
            torch.cuda.synchronize()
        dist.barrier()
        mine = buf.tensor(0, (w, block), torch.int64).cpu()
        return [(mine[s] - torch.arange(block) * 7).unique().tolist() for s in range(w)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_reads_what_every_peer_wrote(world, backend, host_ranks):
    if backend == "cuda" and world == 1:
        pytest.skip("one rank maps no peer: on GPUs the exchange runs at 2 and 4 ranks")
    need_gpus(backend, world)
    if backend == "host":
        results = host_ranks(exchange_pattern, world, NBYTES, backend)
    else:
        results = run(exchange_pattern, world, NBYTES, backend, backend=backend)
    for dst, seen in enumerate(results):
        assert seen == [[_stamp(src, dst)] for src in range(world)]


def peer_tensor_aliases_peer_memory() -> tuple[int, int, bool]:
    buf = ss.SymmetricBuffer(4096, backend="host")
    peer = (buf.rank + 1) % buf.world_size
    t = buf.tensor(32, (4,), torch.int32, rank=peer)
    base = buf.ptrs[peer].item()
    same_as_own = buf.tensor(32, (4,), torch.int32).data_ptr() == t.data_ptr()
    buf.close()
    return t.data_ptr(), base + 32, same_as_own


def test_tensor_is_a_view_of_the_peers_memory_not_a_copy(host_ranks):
    for addr, expected, same in host_ranks(peer_tensor_aliases_peer_memory, 2):
        assert addr == expected
        assert not same


def peer_cells_are_the_peers_cells():
    buf = ss.SymmetricBuffer(4096, backend="host")
    peer = (buf.rank + 1) % buf.world_size
    out = {
        "addr": buf.cell_memory(peer).data_ptr(),
        "expected": buf.cell_ptrs[peer].item(),
        "own": buf.cell_memory(buf.rank).data_ptr() == buf.cell_memory().data_ptr(),
    }
    try:
        buf.cell_memory(buf.world_size)
    except ss.BoundsError as e:
        out["refused"] = str(e)
    buf.close()
    return out


def test_cell_memory_of_a_peer_is_its_cells_as_this_rank_maps_them(host_ranks):
    for out in host_ranks(peer_cells_are_the_peers_cells, 2):
        assert out["addr"] == out["expected"] and out["own"], out
        assert "SymmetricBuffer.cell_memory" in out.get("refused", ""), out


def bad_size_on_one_rank(backend="host"):
    nbytes = 4096 if dist.get_rank() != 1 else 8192
    with pytest.raises(ss.SizeMismatchError) as e:
        ss.SymmetricBuffer(nbytes, backend=backend)
    return str(e.value)


def test_sizes_that_differ_raise_on_every_rank_naming_ranks_and_sizes(backend, host_ranks):
    world = 3 if backend == "host" else 2  # one GPU per rank
    if backend == "host":
        results = host_ranks(bad_size_on_one_rank, world, backend)
    else:
        results = run(bad_size_on_one_rank, world, backend, backend=backend)
    for m in results:
        for r in range(world):
            assert f"rank {r}: {8192 if r == 1 else 4096}" in m, m


def bad_nbytes(value_on_rank_0):
    nbytes = value_on_rank_0 if dist.get_rank() == 0 else 4096
    with pytest.raises(ss.ConfigError) as e:
        ss.SymmetricBuffer(nbytes, backend="host")
    return str(e.value)


@pytest.mark.parametrize("value", [0, -16])
def test_zero_or_negative_size_raises_on_every_rank(value, host_ranks):
    for m in host_ranks(bad_nbytes, 2, value):
        assert "rank 0" in m and "positive" in m and str(value) in m


def bad_views():
    buf = ss.SymmetricBuffer(1024, backend="host")
    errors = {}
    cases = {
        "past_end": lambda: buf.tensor(1024 - 16, (5,), torch.float32),
        "misaligned": lambda: buf.tensor(8, (2,), torch.float32),
        "negative": lambda: buf.tensor(-16, (2,), torch.float32),
        "dtype": lambda: buf.tensor(0, (2,), "float32"),
        "rank": lambda: buf.tensor(0, (2,), torch.float32, rank=buf.world_size),
        "shape": lambda: buf.tensor(0, (-1,), torch.float32),
    }
    for name, fn in cases.items():
        try:
            fn()
        except ss.SymmSyncError as e:
            errors[name] = (type(e).__name__, str(e))
    ok_end = buf.tensor(1024 - 16, (4,), torch.float32).numel()  # exactly fits
    buf.close()
    closed = {}
    for name, fn in {
        "tensor": lambda: buf.tensor(0, (1,), torch.uint8),
        "ptrs": lambda: buf.ptrs,
        "view": lambda: buf.view([buf.rank]),
    }.items():
        try:
            fn()
        except ss.ClosedError as e:
            closed[name] = str(e)
    buf.close()  # idempotent
    return errors, ok_end, closed


def test_views_outside_the_buffer_or_misaligned_raise_and_use_after_close_raises(host_ranks):
    for errors, ok_end, closed in host_ranks(bad_views, 2):
        assert set(errors) == {"past_end", "misaligned", "negative", "dtype", "rank", "shape"}
        assert errors["past_end"][0] == "BoundsError" and "[1008, 1028)" in errors["past_end"][1]
        assert "multiple of 16" in errors["misaligned"][1]
        assert errors["rank"][0] == "BoundsError"  # an index outside what exists
        assert ok_end == 4
        assert set(closed) == {"tensor", "ptrs", "view"} and all("after close" in m for m in closed.values())


def segments_after_close(prefix_env: str):
    prefix = os.environ[prefix_env]
    buf = ss.SymmetricBuffer(1 << 16, backend="host")
    # The names are unlinked as soon as every peer mapped them, before any close.
    linked_while_open = glob.glob(f"/dev/shm/{prefix}-*")
    buf.tensor(0, (16,), torch.uint8).fill_(1)
    dist.barrier()
    buf.close()
    dist.barrier()
    return linked_while_open, glob.glob(f"/dev/shm/{prefix}-*")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="/dev/shm is Linux's view of POSIX shared memory")
def test_no_segment_is_left_in_dev_shm():
    for while_open, after in run(segments_after_close, 4, "SYMMSYNC_SHM_PREFIX"):
        assert while_open == [] and after == []


def backend_choice():
    buf = ss.SymmetricBuffer(1024)  # auto: the ranks run Triton's interpreter, so host (GPUs or not)
    name = buf.backend
    buf.close()
    with pytest.raises(ss.ConfigError) as e:
        ss.SymmetricBuffer(1024, backend="nvshmem")
    return name, str(e.value)


def test_auto_backend_picks_host_under_the_interpreter_and_unknown_backends_raise(host_ranks):
    for name, msg in host_ranks(backend_choice, 2):
        assert name == "host" and "nvshmem" in msg


def test_auto_backend_picks_the_cuda_device_only_outside_the_interpreter(monkeypatch):
    from symmsync import backends
    from symmsync.backends import mode

    monkeypatch.setattr(backends, "default_device", lambda: torch.device("cuda", 0))  # as if a GPU were present
    monkeypatch.setattr(mode, "kernels_interpreted", lambda: True)
    assert backends.resolve("auto", None) == ("host", torch.device("cpu"))
    assert backends.resolve("auto", "cuda:1") == ("cuda", torch.device("cuda", 1))  # an explicit device wins
    assert backends.resolve("host", None) == ("host", torch.device("cpu"))
    monkeypatch.setattr(mode, "kernels_interpreted", lambda: False)
    assert backends.resolve("auto", None) == ("cuda", torch.device("cuda", 0))
    with pytest.raises(ss.ConfigError, match="compiled them"):  # the host backend needs the interpreter
        backends.resolve("host", None)


def test_buffer_needs_an_initialized_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(ss.ConfigError, match="init_process_group"):
        ss.SymmetricBuffer(1024, backend="host")


def map_fails_on_rank_1(prefix_env: str):
    from symmsync.backends import host

    if dist.get_rank() == 1:

        def broken(self, mem, offset, handle):
            raise ss.BackendError("planted mapping failure")

        host.HostBackend.map_chunk = broken  # how a rank maps a peer's memory
    try:
        ss.SymmetricBuffer(1 << 16, backend="host")
    except ss.BackendError as e:
        dist.barrier()
        return str(e), glob.glob(f"/dev/shm/{os.environ[prefix_env]}-*")
    return None, []


def test_a_failed_mapping_on_one_rank_raises_everywhere_and_leaves_nothing():
    for msg, left in run(map_fails_on_rank_1, 3, "SYMMSYNC_SHM_PREFIX"):
        assert msg is not None and "could not map on rank 1" in msg and "planted mapping failure" in msg
        assert "released" in msg and left == []


def adopt_peer_addresses(cells):
    own = ss.SymmetricBuffer(1 << 16, backend="host")  # stands in for a runtime's own mapping
    own.tensor(0, (1 << 16,), torch.uint8).fill_(0xAB)  # the runtime's bytes
    dist.barrier()
    adopted = ss.SymmetricBuffer.from_peer_addresses(own.ptrs.tolist(), 1 << 16, device="cpu", cells=cells)
    fence = ss.Fence(adopted.view([0, 1]), timeout_s=60)
    adopted.tensor(0, (4,), torch.int32, rank=1 - adopted.rank).fill_(adopted.rank + 5)
    fence.fence()
    seen_via_adopted = adopted.tensor(0, (4,), torch.int32).tolist()
    seen_via_owner = own.tensor(0, (4,), torch.int32).tolist()
    untouched = int((own.tensor(16, ((1 << 16) - 16,), torch.uint8) == 0xAB).sum())
    separate_table = adopted.cell_ptrs is not adopted.ptrs
    nbytes = adopted.nbytes
    adopted.close()  # releases nothing: the owner's mapping still works
    still = own.tensor(0, (4,), torch.int32).tolist()
    try:
        ss.SymmetricBuffer.from_peer_addresses(own.ptrs.tolist()[:1], 1 << 16, device="cpu")
    except ss.ConfigError as e:
        short = str(e)
    own.close()
    return seen_via_adopted, seen_via_owner, still, nbytes, short, untouched, separate_table


def test_adopting_memory_a_runtime_mapped_gives_views_and_fences(host_ranks):
    for rank, (adopted, owner, still, nbytes, short, untouched, apart) in enumerate(
        host_ranks(adopt_peer_addresses, 2, "separate")
    ):
        assert adopted == owner == still == [1 - rank + 5] * 4
        assert "1 addresses for a group of 2 ranks" in short
        assert nbytes == 1 << 16 and untouched == (1 << 16) - 16 and apart  # every adopted byte stays the runtime's


def adopt_with_cells_at_the_tail():
    own = ss.SymmetricBuffer(1 << 16, backend="host")
    try:
        ss.SymmetricBuffer.from_peer_addresses(own.ptrs.tolist(), 1 << 16, device="cpu", cells="tail")
        outcome = "adopted"
    except ss.ConfigError as e:
        outcome = str(e)
    own.close()
    return outcome


def test_cells_at_the_tail_of_adopted_memory_are_refused_on_every_rank(host_ranks):
    # The runtime's memory has no guard symmsync controls: the cells always live in its own guarded allocation.
    for msg in host_ranks(adopt_with_cells_at_the_tail, 2):
        assert msg.startswith("SymmetricBuffer.from_peer_addresses: rank 0 (and rank 1): cells='tail' is gone"), msg
        assert "drop the cells argument" in msg, msg


def test_a_tensor_over_raw_memory_owns_it_until_its_last_view_is_gone():
    # The CUDA backend's tensors own their mappings this way; the mechanism is torch's,
    # the same on every device, so it is checked here on CPU memory.
    import gc

    from symmsync import backends

    keep = torch.arange(64, dtype=torch.uint8)  # stands for a mapping: the pointer stays valid
    released = []
    t = backends.tensor_at(keep.data_ptr(), 64, torch.device("cpu"), on_last_use=lambda: released.append(1))
    view = t[16:32].view(torch.int32)[1:]  # a slice of a view of a slice: the same storage
    alias = view.view(3)
    del t
    gc.collect()
    assert released == []
    del view
    gc.collect()
    assert released == [] and alias.tolist() == torch.arange(20, 32, dtype=torch.uint8).view(torch.int32).tolist()
    del alias
    gc.collect()
    assert released == [1]  # once, after the last one
