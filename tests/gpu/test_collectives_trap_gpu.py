"""A trapped collective never leaves a member's ``synchronize()`` hanging silently (GPUs).

Marker ``gpu``: skipped where fewer than 2 GPUs exist, unless ``SYMMSYNC_SHARE_GPUS=1`` (the
ranks then share the GPUs there are). Rank 0 makes a call that rank 1 never makes: rank 0's
wait runs out its budget, records it and traps. Each member then calls
``AllReduce.synchronize()`` under a watchdog and reports what it saw. The oracle: rank 0 raises
``FenceTimeout`` naming rank 1 within the bound; rank 1, which made no call, returns, or, where
the trap left its own ``torch.cuda.synchronize()`` blocked (one shared GPU), raises
``FenceTimeout`` saying so within the bound. On one GPU shared by both processes, a trap in one context has left
the other's ``torch.cuda.synchronize()`` blocked (docs/gpu.md); there the collective detects
the sharing and raises the recorded error without waiting for the device, saying that the
members share a GPU. A member whose ``synchronize()`` neither returns nor raises within the
bound (a silent hang) fails the test.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C
from symmsync.testing import run, sharing_gpus

pytestmark = pytest.mark.gpu
WORLD = 2
TIMEOUT_S = 10.0  # the fence budget of the calls
BOUND_S = 2 * TIMEOUT_S + 60.0  # synchronize() under a shared GPU waits at most 2 * budget + 30 s


def timeout_then_synchronize():
    """Rank function: a good call, then a call rank 1 never makes, then synchronize() in a
    watchdog thread; returns what this rank saw (printed by the test)."""
    rank = dist.get_rank()
    buf = ss.SymmetricBuffer(C.workspace_bytes(1 << 16, torch.float32, WORLD), backend="cuda")
    ar = C.AllReduce(buf.view(list(range(WORLD))), 1 << 16, torch.float32, timeout_s=TIMEOUT_S)
    first = ar(torch.ones(64, device=buf.device))
    ar.synchronize()
    good = first[:2].tolist()
    dist.barrier()
    if rank == 0:
        ar(torch.ones(512, device=buf.device))  # rank 1 never comes: the wait traps after its budget
    seen: dict = {}

    def watched():
        t0 = time.monotonic()
        try:
            ar.synchronize()
            seen.update(outcome="returned")
        except ss.SymmSyncError as e:
            seen.update(outcome="raised", type=type(e).__name__, msg=str(e))
        except Exception as e:  # noqa: BLE001 - a device error that is not symmsync's is reported, not raised
            seen.update(outcome="raised", type=type(e).__name__, msg=str(e))
        seen["elapsed_s"] = time.monotonic() - t0

    thread = threading.Thread(target=watched, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        seen = {"outcome": "hung", "elapsed_s": BOUND_S}
    seen.update(rank=rank, good=good, shares_gpu=list(ar.shares_gpu))
    print(f"rank {rank}: {seen}", flush=True)
    # The trap made this process's CUDA context unusable: no close() (the process ends).
    return seen


@pytest.mark.traps
def test_a_trapped_collective_never_leaves_a_members_synchronize_hanging_silently():
    results = run(timeout_then_synchronize, WORLD, backend="cuda", timeout_s=BOUND_S + 240)
    for r in results:
        print(r)
    shared = sharing_gpus() and torch.cuda.device_count() < WORLD
    for r in results:
        assert r["good"] == [2.0, 2.0], r
        assert r["outcome"] != "hung" and r["elapsed_s"] < BOUND_S, r
        if r["rank"] == 0:  # its wait ran out: neither a result after a trap nor a hang
            assert r["outcome"] == "raised" and r["type"] == "FenceTimeout", r
            assert "rank 1 (its slot holds epoch 1)" in r["msg"], r
        else:
            assert r["outcome"] == "returned" or r["type"] == "FenceTimeout", r
        if shared:  # both members on one GPU: detected, and said in the error
            assert r["shares_gpu"] == [1 - r["rank"]], r
            if r["outcome"] == "raised":
                assert f"rank {r['rank']} shares its GPU with rank(s) {1 - r['rank']}" in r["msg"], r
        else:
            assert r["shares_gpu"] == [], r
