"""The CUDA backend on 2 GPUs: handle types, graph replay, teardown, adoption, publish counts.

Marker ``gpu``: skipped with the reason where fewer than 2 GPUs exist. Run with
``make test-gpu`` (docs/gpu.md), which also runs the ``cuda`` case of every host test
that takes the ``backend`` fixture (exchange, bad sizes, the PCP byte oracle, ...).
"""

import time

import helpers
import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync import pcp
from symmsync.language import cells
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2


@pytest.mark.parametrize("handle_type", ["posix_fd", "cuda_ipc"])
def test_handle_types_map_peers(handle_type):
    for rank, got in enumerate(run(handle_exchange, WORLD, handle_type, backend="cuda")):
        assert got == [1 - rank + 100] * 4


def handle_exchange(handle_type):
    buf = ss.SymmetricBuffer(1 << 16, backend="cuda", backend_options={"handle_type": handle_type})
    peer = 1 - buf.rank
    buf.tensor(0, (4,), torch.int32, rank=peer).fill_(buf.rank + 100)
    torch.cuda.synchronize()
    dist.barrier()
    got = buf.tensor(0, (4,), torch.int32).tolist()
    buf.close()
    return got


def test_cuda_graph_replay_advances_the_device_epoch_and_keeps_the_payload_oracle():
    batches, per_batch = 10, 100  # 1000 replays
    for log in run(helpers.graph_replay, WORLD, batches, per_batch, backend="cuda"):
        assert [d for d, _ in log] == [per_batch] * batches
        assert all(err == 0 for _, err in log), log


def cycles(n):
    torch.cuda.synchronize()
    with ss.SymmetricBuffer(1 << 22, backend="cuda"):  # warm-up: contexts, NCCL buffers
        pass
    torch.cuda.synchronize()
    dist.barrier()  # the device's free memory: measured once every rank released (ranks may share a GPU)
    free_before, _ = torch.cuda.mem_get_info()
    for i in range(n):
        buf = ss.SymmetricBuffer(1 << 22, backend="cuda")
        buf.tensor(0, (16,), torch.int32, rank=(buf.rank + 1) % buf.world_size).fill_(i)
        if (i + buf.rank) % 2:
            time.sleep(0.001)  # ranks close in either order
        buf.close()
        buf.close()
    torch.cuda.synchronize()
    dist.barrier()
    free_after, _ = torch.cuda.mem_get_info()
    return free_before, free_after


def test_200_allocate_close_cycles_leave_device_memory_where_it_started():
    for before, after in run(cycles, WORLD, 200, backend="cuda", timeout_s=600):
        assert abs(before - after) <= 8 << 20, (before, after)  # 200 leaked 4 MiB buffers would be 800 MiB


def map_fails_on_rank_1():
    from symmsync.backends import cuda as cuda_backend

    torch.empty(1, device="cuda")
    with ss.SymmetricBuffer(1 << 22, backend="cuda"):
        pass
    torch.cuda.synchronize()
    # The free memory is the device's: where ranks share a GPU, each measures only once every
    # rank finished releasing (the warm-up buffer here; the failed build below).
    dist.barrier()
    free_before, _ = torch.cuda.mem_get_info()
    if dist.get_rank() == 1:

        def broken(self, mem, offset, handle):
            raise ss.BackendError("planted mapping failure")

        cuda_backend.CudaBackend.map_chunk = broken  # how a rank maps a peer's memory
    try:
        ss.SymmetricBuffer(1 << 24, backend="cuda")
    except ss.BackendError as e:
        torch.cuda.synchronize()
        dist.barrier()
        free_after, _ = torch.cuda.mem_get_info()
        return str(e), free_before - free_after
    return None, 0


def test_a_failed_mapping_on_one_rank_raises_everywhere_and_releases_everything():
    for msg, leaked in run(map_fails_on_rank_1, WORLD, backend="cuda"):
        assert msg is not None and "rank 1" in msg and "planted mapping failure" in msg
        assert leaked < 8 << 20


def adopt_torch_symmetric_memory():
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(1 << 20, dtype=torch.uint8, device=f"cuda:{dist.get_rank()}")
    hdl = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    buf = ss.SymmetricBuffer.from_torch(hdl)
    fence = ss.Fence(buf.view([0, 1]), timeout_s=30)
    buf.tensor(0, (8,), torch.float32, rank=1 - buf.rank).fill_(buf.rank + 0.5)
    fence.fence()
    got = buf.tensor(0, (8,), torch.float32).tolist()
    same_memory = buf.tensor(0, (1,), torch.uint8).data_ptr() == t.data_ptr()
    buf.close()
    return got, same_memory


def test_adopting_torch_symmetric_memory_gives_views_and_fences():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(
            "torch's symmetric memory refuses ranks on one device (allocations from overlapping devices): "
            "needs a GPU per rank"
        )
    for rank, (got, same) in enumerate(run(adopt_torch_symmetric_memory, WORLD, backend="cuda")):
        assert got == [1 - rank + 0.5] * 8 and same


@pytest.mark.parametrize("route,fused", [("direct", False), ("direct", True), ("allgather", False)])
def test_pcp2_byte_oracle_in_cuda_graph_replay(route, fused):
    helpers.need_nccl_in_capture(route, WORLD)
    replays = 4
    for ok, epoch in run(helpers.pcp_graph_replay, WORLD, route, fused, replays, backend="cuda"):
        assert ok == [True] * (2 * replays)
        if route == "direct":
            assert epoch == 2 * (replays + 1)  # one fence per layer, on the warm-up and every replay


@triton.jit
def publish_kernel(ptrs, cell, me, SIZE: tl.constexpr):
    ssl.publish(ptrs, cell, me, SIZE)


def slots_after_publishes(times):
    """Publish ``times`` times from kernels of 1, 2, 4 and 8 warps (one channel each), and
    run the fused writer for 3 layers; return (peer's slot, own epoch) pairs after each."""
    layout = pcp.CacheLayout(num_blocks=4, num_layers=3, base=128)
    buf = ss.SymmetricBuffer(layout.end + 128, backend="cuda", channels=5)
    view = buf.view(list(range(buf.world_size)))
    peer = 1 - view.local_index

    def word(at):
        return int(buf.cell_memory()[at : at + 8].view(torch.int64).item())

    def slot_of(cell):
        return word(cell + cells.SLOTS + 8 * peer)

    out = {}
    for ch, warps in enumerate((1, 2, 4, 8)):
        cell = view.cell_offset(ch)
        for _ in range(times):
            publish_kernel[(1,)](view.cell_ptrs, cell, view.local_index, SIZE=view.size, num_warps=warps)
        torch.cuda.synchronize()
        dist.barrier()
        epoch = word(cell + cells.EPOCH)
        out[f"num_warps={warps}"] = (slot_of(cell), epoch)
    writer = pcp.DirectKVWriter(view, layout, fused=True, channel=4, timeout_s=30)
    split = pcp.pcp_split(200, 2)
    slots = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(0))[:200]
    batch = writer.prepare(split.local_slots(slots, view.local_index).to(buf.device))
    rows = [torch.zeros(split.tokens_per_rank, n, dtype=torch.bfloat16, device=buf.device) for n in (512, 64, 128)]
    for layer in range(3):
        writer.write(layer, *rows, batch)
    writer.fence.synchronize()
    dist.barrier()
    out["fused writer, 3 layers"] = (slot_of(writer.fence.cell), writer.fence.epoch)
    buf.close()
    return out


def test_one_publish_adds_exactly_one_to_each_peer_slot_whatever_num_warps():
    # A slot ahead of its member's epoch would let later waits return before the data arrived.
    for res in run(slots_after_publishes, WORLD, 5, backend="cuda"):
        for what, (slot, epoch) in res.items():
            want = 3 if what.startswith("fused") else 5
            assert slot == epoch == want, (what, slot, epoch)
