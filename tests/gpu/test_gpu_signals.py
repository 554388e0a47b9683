"""Point-to-point signals compiled for NVIDIA GPUs: the pipelined transfer eagerly and in 1000
CUDA graph replays, put_signal from a full block, the grid-wide wait, and Signals refused
during capture. Bytes are checked after every batch of replays.

Marker ``gpu``. Each test runs at the worlds of ``SYMMSYNC_GPU_WORLDS`` (default 2; ``make
test-gpu-shared`` runs 2, 4 and 8 ranks on one GPU under MPS): the pipeline and the full block in
pairs of ranks (``2k``, ``2k + 1``), every pair at the same time on its own view of one buffer; the
grid-wide wait and the refusal during capture over every rank. On one GPU run the ranks sharing
it: ``SYMMSYNC_SHARE_GPUS=1``.
"""

import helpers
import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLDS = helpers.gpu_worlds()
CHUNKS, RING, CHUNK = 8, 4, 256
DATA, CREDIT = tl.constexpr(0), tl.constexpr(1)  # slots (kernels read them as constexprs)


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request):
    helpers.need_gpus("cuda", request.param)
    if helpers.gpu_count() == 0:
        pytest.skip("needs an NVIDIA GPU: run on a GPU machine (SYMMSYNC_SHARE_GPUS=1 for one GPU)")
    return request.param


def _pair(buf):
    """This rank's view of its pair (``2k``, ``2k + 1``): pairs run side by side on one buffer."""
    first = buf.rank - buf.rank % 2
    return buf.view([first, first + 1])


@triton.jit
def producer_kernel(
    sig, me, timeout_ns, record, gen, sent_at, consumer,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
    CHUNKS: tl.constexpr, RING: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    g = tl.load(gen)  # this launch's number, device-resident: replays advance it
    i = tl.arange(0, CHUNK)
    for c in range(CHUNKS):
        ssl.wait_count(sig, me, consumer, CREDIT, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        k = g * CHUNKS + c  # chunks ever sent: the ring's tile is k % RING across replays too
        ssl.put_signal(sig, me, consumer, ((k % RING) * CHUNK + i) * 8, k * 1000 + i + 1, i < CHUNK, DATA, NSLOTS)
        tl.store(sent_at + c, ssl.clock_ns())
    tl.debug_barrier()  # every thread read gen before it moves
    tl.store(gen, g + 1)


@triton.jit
def consumer_kernel(
    sig, me, timeout_ns, record, gen, done_at, errors, last, producer, delay_ns,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
    CHUNKS: tl.constexpr, RING: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    g = tl.load(gen)
    i = tl.arange(0, CHUNK)
    for c in range(CHUNKS):
        ssl.wait_count(sig, me, producer, DATA, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        t0 = ssl.clock_ns()
        t = t0
        while t - t0 < delay_ns:  # a slow consumer
            t = ssl.clock_ns()
        k = g * CHUNKS + c
        v = tl.load(ssl.data_ptr(sig, me, ((k % RING) * CHUNK + i) * 8, tl.int64))
        tl.atomic_add(errors, tl.sum((v != k * 1000 + i + 1).to(tl.int32), axis=0))
        tl.store(last + c * CHUNK + i, v)
        tl.store(done_at + c, ssl.clock_ns())
        tl.debug_barrier()  # every read of the tile before the credit that frees it
        ssl.signal(sig, me, producer, CREDIT, 1, ssl.ADD, NSLOTS)
    tl.debug_barrier()
    tl.store(gen, g + 1)


def _chunks(g):
    """The chunks of launch ``g``, from the rule: chunk k holds k * 1000 + j + 1."""
    k = torch.arange(CHUNKS, dtype=torch.int64)[:, None] + g * CHUNKS
    return (k * 1000 + torch.arange(CHUNK) + 1).flatten()


def pipeline(eager, batches, per_batch, delay_ns):
    buf = ss.SymmetricBuffer(RING * CHUNK * 8, backend="cuda")
    view = _pair(buf)
    sigs = ss.Signals(view, slots=2, timeout_s=60)
    dev = buf.device
    gen = torch.zeros(1, dtype=torch.int64, device=dev)
    stamps = torch.zeros(CHUNKS, dtype=torch.int64, device=dev)
    errors = torch.zeros(1, dtype=torch.int32, device=dev)
    last = torch.zeros(CHUNKS * CHUNK, dtype=torch.int64, device=dev)
    consts = dict(CHUNKS=CHUNKS, RING=RING, CHUNK=CHUNK, num_warps=4, **sigs.constexprs)
    me = view.local_index
    if me == 1:
        sigs.signal(0, CREDIT.value, RING)

    def step():
        if me == 0:
            producer_kernel[(1,)](*sigs.kernel_args, gen, stamps, 1, **consts)
        else:
            consumer_kernel[(1,)](*sigs.kernel_args, gen, stamps, errors, last, 0, delay_ns, **consts)

    log = []
    if eager:
        for _ in range(batches * per_batch):
            step()
        sigs.synchronize()
        log.append(_state(sigs, gen, errors, last, stamps))
    else:
        g = helpers.capture(step)
        for _ in range(batches):
            for _ in range(per_batch):
                g.replay()
            sigs.synchronize()
            # Both sides done with the batch before either reads the counts, and both read before
            # the producer's next batch sends up to RING chunks ahead into them.
            dist.barrier()
            log.append(_state(sigs, gen, errors, last, stamps))
            dist.barrier()
    dist.barrier()
    buf.close()
    return log


def _state(sigs, gen, errors, last, stamps):
    return {
        "gen": int(gen.item()),
        "errors": int(errors.item()),
        "last": last.cpu(),
        "stamps": stamps.cpu(),
        "values": sigs.values(),
        "consumed": sigs.consumed(),
    }


def _check_pipeline(logs, launches_per_batch, warmup=0):
    assert len(logs) % 2 == 0, f"the pipeline runs in pairs of ranks: {len(logs)} ranks"
    for prod, cons in zip(logs[0::2], logs[1::2]):
        _check_pair(prod, cons, launches_per_batch, warmup)


def _check_pair(prod, cons, launches_per_batch, warmup):
    for b, (p, c) in enumerate(zip(prod, cons)):
        n = warmup + (b + 1) * launches_per_batch
        assert p["gen"] == n and c["gen"] == n, (b, p["gen"], c["gen"])
        assert c["errors"] == 0, (b, c["errors"])
        assert torch.equal(c["last"], _chunks(n - 1)), b
        assert c["values"][0, DATA.value] == n * CHUNKS and c["consumed"][0, DATA.value] == n * CHUNKS
        assert p["values"][1, CREDIT.value] == RING + n * CHUNKS and p["consumed"][1, CREDIT.value] == n * CHUNKS
        # one GPU's global timer for both ranks (they share it): the credits held chunk 7 back
        assert int(c["stamps"][0]) < int(p["stamps"][CHUNKS - 1]), b


def test_the_pipeline_runs_eagerly_with_every_chunk_exact_and_in_step(world):
    logs = run(pipeline, world, True, 1, 20, 20_000, backend="cuda")
    _check_pipeline(logs, 20)


def test_the_pipeline_stays_in_step_over_a_thousand_graph_replays_with_no_reset(world):
    logs = run(pipeline, world, False, 10, 100, 2_000, backend="cuda")
    _check_pipeline(logs, 100, warmup=3)  # helpers.capture ran the step 3 times eagerly first


# ---------------------------------------------------------------------- put_signal, a full block
BLOCK = 4096


@triton.jit
def block_kernel(
    sig, me, timeout_ns, record, rnd, errors,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.load(rnd)
    i = tl.arange(0, BLOCK)
    half = (r % 2) * BLOCK * 8  # a fast peer's next round lands in the other half
    ssl.put_signal(sig, me, 1 - me, half + i * 8, r * 1_000_000 + me * 100_000 + i, i < BLOCK, DATA, NSLOTS)
    ssl.wait_count(sig, me, 1 - me, DATA, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
    v = tl.load(ssl.data_ptr(sig, me, half + i * 8, tl.int64))
    tl.atomic_add(errors, tl.sum((v != r * 1_000_000 + (1 - me) * 100_000 + i).to(tl.int32), axis=0))
    tl.debug_barrier()
    tl.store(rnd, r + 1)


def full_block(batches, per_batch):
    buf = ss.SymmetricBuffer(2 * BLOCK * 8, backend="cuda")
    sigs = ss.Signals(_pair(buf), slots=1, timeout_s=60)
    rnd = torch.zeros(1, dtype=torch.int64, device=buf.device)
    errors = torch.zeros(1, dtype=torch.int32, device=buf.device)

    def step():
        block_kernel[(1,)](*sigs.kernel_args, rnd, errors, BLOCK=BLOCK, num_warps=8, **sigs.constexprs)

    g = helpers.capture(step)
    log = []
    for _ in range(batches):
        for _ in range(per_batch):
            g.replay()
        sigs.synchronize()
        log.append((int(rnd.item()), int(errors.item())))
    buf.close()
    return log


def test_put_signal_from_a_full_block_delivers_every_element_in_graph_replay(world):
    for log in run(full_block, world, 10, 100, backend="cuda"):
        assert [r for r, _ in log] == [3 + 100 * (b + 1) for b in range(10)], log
        assert all(e == 0 for _, e in log), log


# ---------------------------------------------------------------------- the grid-wide wait
PART = 128


@triton.jit
def grid_kernel(data, ptrs, cell, me, timeout_ns, record, r, errors, SIZE: tl.constexpr, PART: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    i = tl.arange(0, PART)
    half = (r % 2) * n * PART * SIZE
    for p in tl.static_range(SIZE):  # this program's part, into every member
        dst = ssl.peer_ptr(data, p, 0, tl.int64) + half + (me * n + pid) * PART + i
        tl.store(dst, r * 10_000_000 + (me * n + pid) * PART + i)
    ssl.grid_sync(ptrs, cell, me, timeout_ns, record, SIZE, True)
    q = n - 1 - pid  # read what another program of each member wrote, in this same launch
    for p in tl.static_range(SIZE):
        src = ssl.peer_ptr(data, me, 0, tl.int64) + half + (p * n + q) * PART + i
        v = tl.load(src)
        bad = ((v != r * 10_000_000 + (p * n + q) * PART + i) & (me != p)).to(tl.int32)
        tl.atomic_add(errors, tl.sum(bad, axis=0))


def grid_wide(programs, rounds):
    world = dist.get_world_size()
    buf = ss.SymmetricBuffer(2 * programs * PART * 8 * world, backend="cuda")
    view = buf.view(list(range(world)))
    fence = ss.Fence(view, timeout_s=60)
    errors = torch.zeros(1, dtype=torch.int32, device=buf.device)
    for r in range(rounds):
        ss.launch_grid_sync(grid_kernel, (programs,), view.ptrs, *fence.kernel_args, r, errors, SIZE=world, PART=PART)
    fence.synchronize()
    out = {"rounds": rounds, "errors": int(errors.item()), "epoch": fence.epoch}
    try:
        ss.launch_grid_sync(grid_kernel, (1 << 20,), view.ptrs, *fence.kernel_args, 0, errors, SIZE=world, PART=PART)
    except ss.ConfigError as e:
        out["refused"] = str(e)
    buf.close()
    return out


def test_every_program_waits_for_the_fence_and_reads_peer_data_in_the_same_launch(world):
    for out in run(grid_wide, world, 16, 50, backend="cuda"):
        assert out["rounds"] == 50 and out["errors"] == 0 and out["epoch"] == 50, out
        assert "cannot be co-resident" in out["refused"], out


# ---------------------------------------------------------------------- made during capture
def made_during_capture():
    buf = ss.SymmetricBuffer(1024, backend="cuda")
    view = buf.view(list(range(buf.world_size)))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    msg = None
    with torch.cuda.graph(g):
        try:
            ss.Signals(view)
        except ss.CaptureError as e:
            msg = str(e)
    buf.close()
    return msg


def test_signals_made_during_capture_raise_on_every_rank(world):
    everyone = "ranks " + ", ".join(map(str, range(world)))
    for msg in run(made_during_capture, world, backend="cuda"):  # every rank captured: each is named
        assert msg and "Signals" in msg and everyone in msg and "before capture" in msg, msg
