"""Misuse fails clearly: creation during CUDA graph capture, and stores past the user region.

* Creating a buffer (every constructor), a view, or growing a buffer while a CUDA graph is
  being captured raises ``CaptureError`` on every rank, before any device work, through the
  call's argument exchange. Capture needs a GPU; here the capture condition
  (``symmsync.backends.capturing``) is planted on one rank, which is what the exchange
  carries. tests/gpu/test_gpu_misuse.py captures for real.
* A store past a buffer's user region never lands in a cell: garbage written over
  the bytes just past ``nbytes`` (the slack of its last page) does not make a peer's fence
  pass early (the payload oracle of tests/core/test_fence.py holds) and a fence whose peer
  never arrives still times out. The same garbage written over the cells (through the cell
  table) does both, which shows the oracle sees it. Longer overruns, which reach the guard
  after the user region: tests/core/test_overrun.py.
"""

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers import published, wait_until

import symmsync as ss
from symmsync import backends
from symmsync.core import agreement
from symmsync.language import cells
from symmsync.testing import run
from symmsync.tools.runtime_alloc import HostCacheAllocator

KIB = 1 << 10


def _plant_capture(on_rank):
    if dist.get_rank() == on_rank:
        backends.capturing = lambda device: True  # what a capture on this rank's current stream reads


def _outcome(make):
    try:
        made = make()
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e)
    return "made", repr(made)


# ---------------------------------------------------------------------- capture
def _make(how, rt):
    if how == "allocated":
        return ss.SymmetricBuffer(4096, backend="host")
    if how == "growable":
        return ss.SymmetricBuffer(4096, backend="host", max_nbytes=1 << 20)
    if how == "registered":
        return ss.SymmetricBuffer.register(rt.base, 64 * KIB, max_nbytes=1 << 20, device="cpu")
    own = ss.SymmetricBuffer(1 << 16, backend="host")
    return ss.SymmetricBuffer.from_peer_addresses(own.ptrs.tolist(), 1 << 16, device="cpu")


def construct_while_one_rank_captures(how, prefix_env):
    rt = HostCacheAllocator(1 << 20, chunk=64 * KIB)
    rt.commit(1)
    own = _make("allocated", rt) if how == "adopted" else None  # made before the capture
    _plant_capture(1)
    if how == "adopted":
        out = _outcome(lambda: ss.SymmetricBuffer.from_peer_addresses(own.ptrs.tolist(), 1 << 16, device="cpu"))
    else:
        out = _outcome(lambda: _make(how, rt))
    dist.barrier()
    left = [n for n in glob.glob(f"/dev/shm/{os.environ[prefix_env]}-*") if "-rt-" not in n]  # not the runtime's
    return out, left


CALLS = {
    "allocated": "SymmetricBuffer",
    "growable": "SymmetricBuffer",
    "registered": "SymmetricBuffer.register",
    "adopted": "SymmetricBuffer.from_peer_addresses",
}


@pytest.mark.parametrize("how", list(CALLS))
def test_a_buffer_made_while_one_rank_captures_raises_capture_error_on_every_rank(how):
    for (kind, msg), left in run(construct_while_one_rank_captures, 2, how, "SYMMSYNC_SHM_PREFIX"):
        assert kind == "CaptureError", msg
        assert msg.startswith(f"{CALLS[how]}: rank 1: called while a CUDA graph was being captured"), msg
        assert "Create them before capture" in msg
        assert left == []  # nothing was allocated: the refusal came before any memory


def view_grow_and_fence_while_one_rank_captures():
    buf = ss.SymmetricBuffer(4096, backend="host", max_nbytes=64 * KIB)
    real_capturing = backends.capturing
    _plant_capture(1)
    out = {"view": _outcome(lambda: buf.view([0, 1])), "grow": _outcome(lambda: buf.grow(8 * KIB))}
    out["nbytes"] = buf.nbytes
    backends.capturing = real_capturing  # the capture ended: the same calls work, nothing was taken
    view = buf.view([0, 1])
    out["region"] = view.region
    _plant_capture(1)
    out["fence"] = _outcome(lambda: ss.Fence(view, timeout_s=30))
    backends.capturing = real_capturing
    fence = ss.Fence(view, timeout_s=30)
    buf.grow(8 * KIB)
    fence.fence()
    out["after"] = buf.nbytes, fence.epoch
    buf.close()
    return out


def test_views_grows_and_fences_made_during_capture_raise_and_take_nothing():
    for rank, out in enumerate(run(view_grow_and_fence_while_one_rank_captures, 2)):
        for call in ("view", "grow"):
            kind, msg = out[call]
            name = "view" if call == "view" else "SymmetricBuffer.grow"
            assert kind == "CaptureError" and msg.startswith(f"{name}: rank 1: called while a CUDA graph"), msg
        assert out["nbytes"] == 4096 and out["region"] == 0  # the refused view took no region
        if rank == 1:  # creating a fence is local: the capturing rank refuses
            kind, msg = out["fence"]
            assert kind == "CaptureError" and msg.startswith("rank 1: Fence: called while a CUDA graph"), msg
            assert "Create fences before capture" in msg
        else:
            assert out["fence"][0] == "made", out["fence"]
        assert out["after"] == (8 * KIB, 1)


def where_the_exchange_runs_on_the_device():
    agreement._exchange_on_device = lambda group: True  # an NCCL group: its exchange would be captured
    backends.capturing = lambda device: True
    return _outcome(lambda: ss.SymmetricBuffer(4096, backend="host"))


def test_a_capturing_rank_whose_exchange_needs_the_device_raises_before_the_exchange():
    for rank, (kind, msg) in enumerate(run(where_the_exchange_runs_on_the_device, 2)):
        assert kind == "CaptureError" and msg.startswith(f"rank {rank}: SymmetricBuffer: called while"), msg


# ---------------------------------------------------------------------- stores past the user region
NBYTES = 1000  # not a multiple of a page: the bytes just past it are mapped
GARBAGE = 3 * KIB  # how far past the user region the stray stores reach
ROUNDS = 4
LATE_S = 0.3  # how long the late rank waits between its stray stores and its payload


def _buffer(kind):
    if kind == "allocated":
        return ss.SymmetricBuffer(NBYTES, backend="host"), None
    if kind == "growable":  # its reservation ends at a page: the guard follows
        return ss.SymmetricBuffer(NBYTES, backend="host", max_nbytes=4 * KIB), None
    own = ss.SymmetricBuffer(1 << 16, backend="host")  # the runtime's mapping: the garbage lands in its bytes
    return ss.SymmetricBuffer.from_peer_addresses(own.ptrs.tolist(), NBYTES, device="cpu"), own


def _scribble(table, target, start, n):
    """Stray stores: ``n`` garbage bytes from ``start`` of each of ``target``'s memory in
    ``table``, through raw addresses (as a kernel that overran would). 0x7F... reads as a
    huge epoch count."""
    for r in target:
        backends.tensor_at(int(table[r]) + start, n, torch.device("cpu")).fill_(0x7F)


def stray_stores(kind, over_cells):
    """Rank 1 is late on every fence; before it stamps its payload it writes garbage just past
    the user region of both ranks (``over_cells``: over rank 0's fence slots instead). Rank 0
    then checks what it read after each fence; at the end rank 1 never arrives."""
    buf, keep = _buffer(kind)
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=60)
    me = buf.rank
    payload = 0
    if over_cells:
        table, start, target = buf.cell_ptrs, fence.cell + cells.SLOTS, [0]
    else:
        table, start, target = buf.ptrs, buf.nbytes, [0, 1]
    errors = 0
    dist.barrier()
    for e in range(1, ROUNDS + 1):
        if me == 1:
            _scribble(table, target, start, 8 * view.size if over_cells else GARBAGE)
            # Rank 0 has published fence e: it is in its wait for rank 1, with the garbage in place.
            wait_until(lambda: published(buf, fence, 0) >= e, f"rank 0 to publish fence {e}")  # noqa: B023 - called at once
            # How many of its polls then see the garbage no host check can observe; LATE_S gives it
            # several. The oracle does not rest on it: errors counts what rank 0 read after each fence.
            time.sleep(LATE_S)
        for p in range(view.size):
            view.tensor(payload, (2, view.size), torch.int64, index=p)[e % 2, me] = e * 1000 + me
        fence.fence()
        got = view.tensor(payload, (2, view.size), torch.int64)[e % 2]
        errors += int((got != torch.arange(view.size) + 1000 * e).sum())
    dist.barrier()
    last = "no fence"
    if me == 1:
        _scribble(table, target, start, 8 * view.size if over_cells else GARBAGE)
    else:
        short = ss.Fence(view, timeout_s=1.0)  # the same channel, a short budget
        try:
            short.fence()
            last = "passed"
        except ss.FenceTimeout as err:
            last = type(err).__name__, err.late
    dist.barrier()
    buf.close()
    if keep is not None:
        keep.close()
    return errors, last


@pytest.mark.parametrize("kind", ["allocated", "growable", "adopted"])
def test_stores_past_the_user_region_never_make_a_fence_pass_early(kind, host_ranks):
    for rank, (errors, last) in enumerate(host_ranks(stray_stores, 2, kind, False)):
        assert errors == 0  # every fence waited for the late rank's payload
        if rank == 0:
            assert last == ("FenceTimeout", {1: ROUNDS}), last  # and one it never reached timed out


def test_the_same_garbage_over_the_cells_makes_the_fence_pass_early_and_the_oracle_sees_it(host_ranks):
    for rank, (errors, last) in enumerate(host_ranks(stray_stores, 2, "allocated", True)):
        if rank == 0:
            assert errors > 0 and last == "passed", (errors, last)
