"""No overrun reaches a cell on a GPU: the store into the guard traps the writer's kernel.

The GPU counterpart of tests/core/test_overrun.py. Rank 1 arrives at a fence; a compiled
kernel on rank 0 stores 128 KiB of plausible counts (``0x7F7F...``) from 1 KiB before the
end of the mapped part of rank 1's user region (the user region is rounded up to the
CUDA granularity, 2 MiB), through rank 0's mapping of rank 1's memory (``buf.ptrs[1]``),
so the stores cross into the guard after it; then rank 1 waits. Rank 0's kernel must trap
with an illegal address (its ``synchronize()`` raises), and rank 1's wait must raise
``FenceTimeout`` (or ``PeerAborted``), never pass. The control stores the same counts over
rank 0's slot in rank 1's cell (through the cell table), which makes the wait pass. Each
rank prints what it saw.

Marker ``gpu``: 2 ranks, on 2 GPUs or sharing one (``SYMMSYNC_SHARE_GPUS=1``, collectives
on gloo); skipped where no GPU exists.
"""

import os
import time
from pathlib import Path

import helpers
import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.language import cells
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2
KIB = 1024
GRANULARITY = 2 << 20  # the CUDA backend's allocation granularity (H100, H200)
NBYTES = GRANULARITY - KIB  # the user region ends 1 KiB before its mapped bytes do
LONG = 128 * KIB
GARBAGE = 0x7F7F7F7F7F7F7F7F
BUDGET_S = 5.0
BLOCK = 1024


@pytest.fixture(autouse=True)
def _gpus():
    helpers.need_gpus("cuda", WORLD)
    if helpers.gpu_count() == 0:
        pytest.skip("needs an NVIDIA GPU: run on a GPU machine (SYMMSYNC_SHARE_GPUS=1 for one GPU)")


@triton.jit
def store_words(table, index, offset, n, value, BLOCK: tl.constexpr):
    """``n`` int64 ``value``s from byte ``offset`` of member ``index``'s memory in ``table``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst = ssl.peer_ptr(table, index, offset, tl.int64)
    tl.store(dst + i, value, mask=i < n)


def _store(table, index, offset, nbytes):
    n = nbytes // 8
    store_words[(triton.cdiv(n, BLOCK),)](table, index, offset, n, GARBAGE, BLOCK=BLOCK)
    torch.cuda.synchronize()


def _waited(fence):
    try:
        fence.wait()
        fence.synchronize()
    except (ss.FenceTimeout, ss.PeerAborted) as e:
        return type(e).__name__
    return "passed"


def overrun(kind, done):
    if kind == "allocated":
        buf = ss.SymmetricBuffer(NBYTES, backend="cuda")
    else:
        buf = ss.SymmetricBuffer(NBYTES, backend="cuda", max_nbytes=4 * GRANULARITY)
    me = buf.rank
    views = {name: buf.view([0, 1]) for name in ("long", "control")}
    fences = {name: ss.Fence(v, timeout_s=BUDGET_S) for name, v in views.items()}
    store_words.warmup(buf.ptrs, 1, 0, 1, GARBAGE, BLOCK=BLOCK, grid=(1,))  # compiled before the handshakes
    out = {}
    if me == 1:
        fences["control"].arrive()
    dist.barrier()
    if me == 0:  # rank 0's count in rank 1's cell, written through the cell table
        _store(views["control"].cell_ptrs, 1, fences["control"].cell + cells.SLOTS, 8)
    dist.barrier()
    if me == 1:
        out["control"] = _waited(fences["control"])
        fences["long"].arrive()
    dist.barrier()
    if me == 0:
        try:
            _store(buf.ptrs, 1, NBYTES, LONG)
            out["long"] = "stores completed"
        except RuntimeError as e:  # the trap: the context is unusable from here on
            out["long"] = f"trapped: {e}"
        Path(done).write_text("yes")
        print(f"rank 0 ({kind}): {out}", flush=True)
        return out
    deadline = time.monotonic() + 120
    while not os.path.exists(done):
        assert time.monotonic() < deadline, "rank 0 never finished its stores"
        time.sleep(0.01)
    out["long"] = _waited(fences["long"])
    print(f"rank 1 ({kind}): {out}", flush=True)
    return out


@pytest.mark.traps
@pytest.mark.parametrize("kind", ["allocated", "growable"])
def test_an_overrun_into_the_guard_traps_the_writer_and_never_makes_a_fence_pass(kind, tmp_path):
    writer, reader = run(overrun, WORLD, kind, str(tmp_path / "done"), backend="cuda", timeout_s=300)
    print(f"{kind}: writer {writer}, reader {reader}")
    assert reader["control"] == "passed", reader  # the oracle sees a pass when there is one
    assert reader["long"] in ("FenceTimeout", "PeerAborted"), reader  # never "passed"
    assert writer["long"].startswith("trapped:") and "illegal" in writer["long"], writer
