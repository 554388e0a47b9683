"""Soak on 2 GPUs (or at the largest world of ``SYMMSYNC_GPU_WORLDS``): a million fences in CUDA-graph
replay with the payload oracle and random delays.

Each step of the captured graph is: delay, stamp the next epoch's payload into every
member (double-buffered by epoch parity), delay, fence, delay, check every member's
stamp of the current epoch. The delays are pseudo-random per rank and epoch (a spin on
``symmsync.language.clock_ns()``, the GPU's ``%globaltimer``, of up to ``MAX_DELAY_NS``
on one step in four), so ranks drift apart and a fence that let a rank through early
would show as a wrong read. The same graph with ``arrive()`` instead of ``fence()`` (no
wait) must show wrong reads: that proves the oracle bites. ``SYMMSYNC_SOAK_FENCES`` sets
the count (default 1 000 000).
"""

import os
import time

import helpers
import pytest
import torch
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = max(helpers.gpu_worlds())  # the largest of SYMMSYNC_GPU_WORLDS (default 2; make test-gpu-shared: 8)
FENCES = int(os.environ.get("SYMMSYNC_SOAK_FENCES", "1000000"))
PER_GRAPH = 1000  # steps (fences) per captured graph
MAX_DELAY_NS = 20_000


@triton.jit
def jitter(ptrs, cell, me, salt, max_ns):
    """Spin for a pseudo-random time on one step in four, chosen by (epoch, rank, salt)."""
    e = tl.load(ssl.epoch_ptr(ptrs, cell, me))
    h = ((e + 1) * 2654435761 + me * 40503 + salt * 97) % 4096
    ns = tl.where(h < 1024, h * max_ns // 1024, 0)
    start = ssl.clock_ns()
    while ssl.clock_ns() - start < ns:
        pass


def soak(total, per_graph, wait):
    buf = ss.SymmetricBuffer(1 << 16, backend="cuda")
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=30)
    errors = torch.zeros(1, dtype=torch.int32, device=buf.device)
    args = (view.ptrs, view.cell_ptrs, fence.cell, 0, view.local_index)
    spin = (view.cell_ptrs, fence.cell, view.local_index)

    def step():
        for _ in range(per_graph):
            jitter[(1,)](*spin, 0, MAX_DELAY_NS)
            helpers.stamp_next_epoch[(1,)](*args, SIZE=view.size)
            jitter[(1,)](*spin, 1, MAX_DELAY_NS)
            fence.fence() if wait else fence.arrive()
            jitter[(1,)](*spin, 2, MAX_DELAY_NS)
            helpers.check_current_epoch[(1,)](*args, errors, SIZE=view.size)

    g = helpers.capture(step, warmup=1)
    fence.synchronize()
    start_epoch, start_errors = fence.epoch, int(errors.item())
    t0 = time.perf_counter()
    for _ in range(total // per_graph):
        g.replay()
    fence.synchronize()
    seconds = time.perf_counter() - t0
    result = {
        "fences": fence.epoch - start_epoch,
        "wrong_reads": int(errors.item()) - start_errors,
        "warmup_wrong_reads": start_errors,
        "seconds": seconds,
    }
    buf.close()
    return result


def test_a_million_fences_in_graph_replay_read_no_stale_payload():
    helpers.need_gpus("cuda", WORLD)
    results = run(soak, WORLD, FENCES, PER_GRAPH, True, backend="cuda", timeout_s=600)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r['fences']} fences, {r['wrong_reads']} wrong reads in {r['seconds']:.1f} s")
        assert r["fences"] == FENCES and r["wrong_reads"] == 0 and r["warmup_wrong_reads"] == 0, r


def test_the_soak_oracle_bites_without_the_wait():
    helpers.need_gpus("cuda", WORLD)
    results = run(soak, WORLD, 10 * PER_GRAPH, PER_GRAPH, False, backend="cuda", timeout_s=300)
    print("no wait:", results)
    assert sum(r["wrong_reads"] for r in results) > 0, results
