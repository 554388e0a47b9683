"""The CUDA backend on 2 GPUs: the core and fence behaviours, graph replay, timeouts, teardown.

Marker ``gpu``: skipped with the reason where fewer than 2 GPUs exist. Run with
``make test-gpu`` (docs/gpu.md).
"""

import time

import pytest
import test_buffer
import test_fence
import test_pcp
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync import pcp
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2


def cuda_exchange(nbytes):
    with ss.SymmetricBuffer(nbytes, backend="cuda") as buf:
        r, w = buf.rank, buf.world_size
        assert buf.device == torch.device("cuda", r) and buf.backend == "cuda"
        assert buf.ptrs.is_cuda and buf.ptrs.dtype == torch.int64
        block = nbytes // w // 8
        for p in range(w):
            t = buf.tensor(r * block * 8, (block,), torch.int64, rank=p)
            assert t.device == buf.device  # peer memory as a tensor on this rank's device
            t.copy_(torch.arange(block, device=buf.device) * 7 + test_buffer._stamp(r, p))
        torch.cuda.synchronize()
        dist.barrier()
        mine = buf.tensor(0, (w, block), torch.int64).cpu()
        return [(mine[s] - torch.arange(block) * 7).unique().tolist() for s in range(w)]


def test_every_rank_reads_what_every_peer_wrote_on_gpus():
    for dst, seen in enumerate(run(cuda_exchange, WORLD, 1 << 20, backend="cuda")):
        assert seen == [[test_buffer._stamp(src, dst)] for src in range(WORLD)]


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


def test_bad_sizes_raise_on_every_rank_on_gpus():
    msgs = run(test_buffer.bad_size_on_one_rank_cuda, 2, backend="cuda")
    assert all("rank 1: 8192" in m for m in msgs)


def test_fence_payload_oracle_on_gpus():
    for res in run(test_fence.payload_oracle, WORLD, 200, "fence", None, "cuda", backend="cuda"):
        assert res["errors"] == 0 and res["epoch"] == 200
        assert res["path"] == "cuda-python"  # the fast launch path, not Triton's launcher


def test_split_phase_overlap_and_channels_on_gpus():
    for mode in ("split", "overlap"):
        for res in run(test_fence.payload_oracle, WORLD, 200, mode, None, "cuda", backend="cuda"):
            assert res["errors"] == 0 and res["epoch"] == 200, mode
    for errors, epochs in run(test_fence.interleaved_channels, WORLD, 100, "cuda", backend="cuda"):
        assert errors == 0 and epochs == [100, 100]


@triton.jit
def stamp_next_epoch(ptrs, cell, payload, me, SIZE: tl.constexpr):
    e = tl.load(ssl.epoch_ptr(ptrs, cell, me)) + 1  # the epoch the next fence publishes
    for p in tl.static_range(SIZE):
        dst = ssl.peer_ptr(ptrs, p, payload, tl.int64)
        tl.store(dst + (e % 2) * SIZE + me, e * 1000 + me)


@triton.jit
def check_current_epoch(ptrs, cell, payload, me, errors, SIZE: tl.constexpr):
    e = tl.load(ssl.epoch_ptr(ptrs, cell, me))
    idx = tl.arange(0, 32)
    own = ssl.peer_ptr(ptrs, me, payload, tl.int64)
    got = tl.load(own + (e % 2) * SIZE + idx, mask=idx < SIZE, other=0)
    bad = tl.sum(((got != e * 1000 + idx) & (idx < SIZE)).to(tl.int32), axis=0)
    tl.atomic_add(errors, bad)


def capture(step, warmup=3):
    """Run ``step`` eagerly on a side stream (compiling everything), then capture it once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


def graph_replay(batches, per_batch):
    buf = ss.SymmetricBuffer(1 << 16, backend="cuda")
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=30)
    errors = torch.zeros(1, dtype=torch.int32, device=buf.device)
    args = (view.ptrs, fence.cell, 0, view.local_index)

    def step():
        stamp_next_epoch[(1,)](*args, SIZE=view.size)
        fence.fence()
        check_current_epoch[(1,)](*args, errors, SIZE=view.size)

    g = capture(step)
    log = []
    for _b in range(batches):
        before = fence.epoch
        for _ in range(per_batch):
            g.replay()
        fence.synchronize()
        log.append((fence.epoch - before, int(errors.item())))
    buf.close()
    return log


def test_cuda_graph_replay_advances_the_device_epoch_and_keeps_the_payload_oracle():
    batches, per_batch = 10, 100  # 1000 replays
    for log in run(graph_replay, WORLD, batches, per_batch, backend="cuda"):
        assert [d for d, _ in log] == [per_batch] * batches
        assert all(err == 0 for _, err in log), log


def test_a_rank_that_skips_the_fence_makes_the_other_trap_and_raise_fence_timeout():
    results = run(
        test_fence.one_rank_never_arrives, WORLD, 2.0, 1, "cuda", backend="cuda", dist_backend="gloo", timeout_s=180
    )
    r = results[0]
    assert isinstance(r, dict), r
    assert r["rank"] == 0 and r["late"] == {1: 1} and r["epoch"] == 2
    assert "rank 1 (its slot holds epoch 1)" in r["msg"]


def cycles(n):
    torch.cuda.synchronize()
    with ss.SymmetricBuffer(1 << 22, backend="cuda"):  # warm-up: contexts, NCCL buffers
        pass
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    for i in range(n):
        buf = ss.SymmetricBuffer(1 << 22, backend="cuda")
        buf.tensor(0, (16,), torch.int32, rank=(buf.rank + 1) % buf.world_size).fill_(i)
        if (i + buf.rank) % 2:
            time.sleep(0.001)  # ranks close in either order
        buf.close()
        buf.close()
    torch.cuda.synchronize()
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
    free_before, _ = torch.cuda.mem_get_info()
    if dist.get_rank() == 1:

        def broken(self, handle, owner):
            raise ss.BackendError("planted mapping failure")

        cuda_backend.CudaBackend.import_handle = broken
    try:
        ss.SymmetricBuffer(1 << 24, backend="cuda")
    except ss.BackendError as e:
        torch.cuda.synchronize()
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
    for rank, (got, same) in enumerate(run(adopt_torch_symmetric_memory, WORLD, backend="cuda")):
        assert got == [1 - rank + 0.5] * 8 and same


def test_pcp2_byte_oracle_on_gpus_eagerly():
    test_pcp._assert_oracle(run(test_pcp.byte_oracle, WORLD, 1, 1000, 3, 5, "cuda", backend="cuda"), 3)


def pcp_graph_replay(route, fused, replays, tp=1):
    """Capture one prefill step (every layer's write) once, replay it on fresh inputs, check every replica.

    With ``tp`` > 1 the ranks form TP×PCP: each TP rank writes only inside its PCP subgroup, and every
    subgroup gets a different prompt, so a byte that crossed subgroups would fail the oracle."""
    tokens, layers = 700, 2
    layout = pcp.CacheLayout(num_blocks=tokens // 64 + 2, num_layers=layers, base=128)
    buf = ss.SymmetricBuffer(layout.end + 128, backend="cuda")
    view = ss.pcp_view(buf, tp=tp)
    world = dist.get_world_size()
    groups = [[k * tp + t for k in range(world // tp)] for t in range(tp)]
    group = dist.new_subgroups_by_enumeration(groups)[0] if tp > 1 else None
    writer = pcp.DirectKVWriter(view, layout, route=route, fused=fused, group=group, timeout_s=30)
    split = pcp.pcp_split(tokens, view.size)
    me = view.local_index
    salt = 10_000 * view.ranks[0]  # one prompt per PCP subgroup
    static = [torch.zeros(split.tokens_per_rank, w, dtype=torch.bfloat16, device=buf.device) for w in (512, 64, 128)]
    _, _, _, slots = test_pcp.prompt(salt, tokens, layout.num_slots)
    batch = writer.prepare(split.local_slots(slots, me).to(buf.device))

    def step():
        for layer in range(layers):
            writer.write(layer, *static, batch)

    g = capture(step, warmup=1)
    ok = []
    for rep in range(replays):
        kv, pe, ix, _ = test_pcp.prompt(salt + 100 + rep, tokens, layout.num_slots, special=True)
        for dst, src in zip(static, (kv, pe, ix)):
            dst.copy_(split.local_rows(src, me))
        torch.cuda.synchronize()
        dist.barrier()  # every rank's inputs are in place before any replica is written
        g.replay()
        if writer.fence is not None:
            writer.fence.synchronize()
        torch.cuda.synchronize()
        dist.barrier()
        want = test_pcp.reference_cache(layout, kv, pe, ix, slots)
        for layer in range(layers):
            ok.append(
                torch.equal(layout.main_kv(buf, layer).cpu(), want[0])
                and torch.equal(layout.indexer_k(buf, layer).cpu(), want[1])
            )
        dist.barrier()  # nobody overwrites inputs of the next replay while a peer still checks
    epoch = writer.fence.epoch if writer.fence is not None else None
    buf.close()
    return ok, epoch


@pytest.mark.parametrize("route,fused", [("direct", False), ("direct", True), ("allgather", False)])
def test_pcp2_byte_oracle_in_cuda_graph_replay(route, fused):
    replays = 4
    for ok, epoch in run(pcp_graph_replay, WORLD, route, fused, replays, backend="cuda"):
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

    def slot_of(cell):
        return int(buf.local_memory()[cell + 128 + 8 * peer : cell + 136 + 8 * peer].view(torch.int64).item())

    out = {}
    for ch, warps in enumerate((1, 2, 4, 8)):
        cell = view.signal_offset(ch)
        for _ in range(times):
            publish_kernel[(1,)](view.ptrs, cell, view.local_index, SIZE=view.size, num_warps=warps)
        torch.cuda.synchronize()
        dist.barrier()
        epoch = int(buf.local_memory()[cell : cell + 8].view(torch.int64).item())
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
