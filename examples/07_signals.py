"""Tutorial 7: point-to-point signals: a pipelined transfer with credits, and a ring exchange.

    python examples/07_signals.py                  # host backend: the pipeline at 2 ranks, the ring at 3 and 4
    python examples/07_signals.py --backend cuda   # compiled for the GPUs (the ring at as many as there are)
    torchrun --nproc-per-node 3 examples/07_signals.py   # torchrun's processes are the ranks

The pipeline: rank 0 sends 8 chunks to rank 1 through a ring of 4 tiles in rank 1's memory.
Rank 1 starts on chunk i as soon as it arrives, and is slow; rank 0 reuses a tile only once
rank 1 handed it back (a credit). The ring exchange: every rank passes blocks to the next
one until every rank holds every rank's block (an all-gather), round after round.
"""

# --8<-- [start:imports]
import argparse
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import is_main_process, run

CHUNKS, RING, CHUNK = 8, 4, 256  # chunks sent, tiles in the ring, int64 values per chunk
# The two slots: "a chunk arrived" (at the consumer), "a tile is free" (at the producer);
# constexprs, so that kernels may read them (the host takes .value)
DATA, CREDIT = tl.constexpr(0), tl.constexpr(1)
# --8<-- [end:imports]


# --8<-- [start:producer]
@triton.jit
def producer_kernel(
    sig, me, timeout_ns, record, src, sent_at, consumer,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
    CHUNKS: tl.constexpr, RING: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, CHUNK)
    failed = me * 0
    for c in range(CHUNKS):
        # a free tile: the consumer granted RING credits before the first chunk, then one per chunk
        failed += ssl.wait_count(sig, me, consumer, CREDIT, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        tile = ((c % RING) * CHUNK + i) * 8  # byte offsets in the consumer's memory
        live = (i < CHUNK) & (i * 0 + failed == 0)
        # the whole block stores the tile, then thread 0 adds 1 to the consumer's DATA slot (release)
        ssl.put_signal(sig, me, consumer, tile, tl.load(src + c * CHUNK + i), live, DATA, NSLOTS)
        tl.store(sent_at + c, ssl.clock_ns())
        # --8<-- [end:producer]


# --8<-- [start:consumer]
@triton.jit
def consumer_kernel(
    sig, me, timeout_ns, record, out, done_at, producer, delay_ns,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
    CHUNKS: tl.constexpr, RING: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, CHUNK)
    failed = me * 0
    for c in range(CHUNKS):
        # one more chunk arrived (acquire): counted from a device-resident base, so replays need no reset
        failed += ssl.wait_count(sig, me, producer, DATA, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        t0 = ssl.clock_ns()
        t = t0
        while t - t0 < delay_ns:  # a slow consumer: the tile stays in use a while
            t = ssl.clock_ns()
        tile = tl.load(ssl.data_ptr(sig, me, ((c % RING) * CHUNK + i) * 8, tl.int64))
        tl.store(out + c * CHUNK + i, tile * 2, mask=(i < CHUNK) & (i * 0 + failed == 0))
        tl.store(done_at + c, ssl.clock_ns())
        tl.debug_barrier()  # every thread's read of the tile before the credit that frees it
        ssl.signal(sig, me, producer, CREDIT, 1, ssl.ADD, NSLOTS)
        # --8<-- [end:consumer]


# --8<-- [start:pipeline]
def pipeline(backend: str, delay_s: float) -> dict:
    buf = ss.SymmetricBuffer(RING * CHUNK * 8, backend=backend)
    view = buf.view(list(range(buf.world_size)))  # every rank takes part in making it; 0 and 1 transfer
    sigs = ss.Signals(view, slots=2, timeout_s=60)
    dev = buf.device
    stamps = torch.zeros(CHUNKS, dtype=torch.int64, device=dev)
    consts = dict(CHUNKS=CHUNKS, RING=RING, CHUNK=CHUNK, **sigs.constexprs)
    src = torch.arange(CHUNKS * CHUNK, dtype=torch.int64, device=dev) + 1
    result = {}
    if view.local_index == 0:
        producer_kernel[(1,)](*sigs.kernel_args, src, stamps, 1, **consts)
    elif view.local_index == 1:
        out = torch.zeros(CHUNKS * CHUNK, dtype=torch.int64, device=dev)
        sigs.signal(0, CREDIT.value, RING)  # every tile starts free
        consumer_kernel[(1,)](*sigs.kernel_args, out, stamps, 0, int(delay_s * 1e9), **consts)
        result["exact"] = torch.equal(out, 2 * src)
    sigs.synchronize()  # raises SignalTimeout if a wait ran out
    result["stamps"] = stamps.cpu()
    dist.barrier()
    buf.close()
    return result
    # --8<-- [end:pipeline]


# --8<-- [start:ring]
N = 64  # int64 values per block


@triton.jit
def ring_kernel(
    sig, me, timeout_ns, record, out, rnd,
    SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, N: tl.constexpr,
):  # fmt: skip
    nxt = (me + 1) % SIZE
    prv = (me + SIZE - 1) % SIZE
    i = tl.arange(0, N)
    # the next rank finished reading last round's blocks: its memory may be written again
    failed = ssl.wait_count(sig, me, nxt, CREDIT, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
    block = rnd * 100_000 + me * 1000 + i  # my own block
    for s in tl.static_range(SIZE - 1):
        origin = (me + SIZE - s) % SIZE  # whose block I pass on at step s (mine at step 0)
        ssl.put_signal(sig, me, nxt, (origin * N + i) * 8, block, (i < N) & (i * 0 + failed == 0), DATA, NSLOTS)
        failed += ssl.wait_count(sig, me, prv, DATA, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        came = (me + SIZE - s - 1) % SIZE  # the previous rank passed on this one
        block = tl.load(ssl.data_ptr(sig, me, (came * N + i) * 8, tl.int64))
        tl.store(out + came * N + i, block)
    tl.store(out + me * N + i, rnd * 100_000 + me * 1000 + i)
    tl.debug_barrier()  # every read of my memory before the credit that lets the previous rank write it
    ssl.signal(sig, me, prv, CREDIT, 1, ssl.ADD, NSLOTS)


def ring(backend: str, rounds: int) -> int:
    buf = ss.SymmetricBuffer(dist.get_world_size() * N * 8, backend=backend)  # a block per rank
    view = buf.view(list(range(buf.world_size)))
    sigs = ss.Signals(view, slots=2, timeout_s=60)
    sigs.signal((view.local_index + view.size - 1) % view.size, CREDIT.value, 1)  # my memory starts free
    wrong = 0
    for rnd in range(rounds):
        out = torch.zeros(view.size * N, dtype=torch.int64, device=buf.device)
        ring_kernel[(1,)](*sigs.kernel_args, out, rnd, N=N, **sigs.constexprs)
        sigs.synchronize()
        want = rnd * 100_000 + torch.arange(view.size)[:, None] * 1000 + torch.arange(N)
        wrong += int((out.cpu().view(view.size, N) != want).sum())
    dist.barrier()
    buf.close()
    return wrong
    # --8<-- [end:ring]


# --8<-- [start:main]
def report_pipeline(results: list[dict]) -> None:
    # Both stamps come from one clock: the host's (host backend) or the GPU's global timer
    # (ranks sharing a GPU; across GPUs the timers agree only roughly).
    sent, done = results[0]["stamps"], results[1]["stamps"]
    assert results[1]["exact"], "a chunk arrived wrong"
    assert int(done[0]) < int(sent[CHUNKS - 1]), "the producer ran past the ring: chunk 7 went before chunk 0 was done"
    if is_main_process():
        print(
            f"pipeline: {CHUNKS} chunks through a ring of {RING} tiles to a slow consumer: every chunk exact; "
            "chunk 0 was done before chunk 7 was sent"
        )


def report_ring(world: int, wrong: list[int], rounds: int) -> None:
    assert wrong == [0] * world, wrong
    if is_main_process():
        print(f"ring exchange on {world} ranks: {rounds} rounds, every block exact")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 7: point-to-point signals")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    delay_s, rounds = (0.05, 3) if args.backend == "host" else (1e-4, 100)
    if "WORLD_SIZE" in os.environ:  # torchrun's ranks
        world = int(os.environ["WORLD_SIZE"])
        report_pipeline(run(pipeline, world, args.backend, delay_s, backend=args.backend))
        report_ring(world, run(ring, world, args.backend, rounds, backend=args.backend), rounds)
    else:  # run() starts the processes: the pipeline at 2 ranks, the ring at 3 and 4
        report_pipeline(run(pipeline, 2, args.backend, delay_s, backend=args.backend))
        gpus = torch.cuda.device_count() if args.backend == "cuda" else 4
        for world in [w for w in (3, 4) if w <= gpus or os.environ.get("SYMMSYNC_SHARE_GPUS") == "1"]:
            report_ring(world, run(ring, world, args.backend, rounds, backend=args.backend), rounds)
# --8<-- [end:main]
