"""Fail closed in compiled kernels: an index out of range traps after
its record, and the host raises IndexCheckError from it; a wait through the kept arguments of a
closed Signals object returns 2 whatever the slot holds.

Marker ``gpu``. Two ranks; on one GPU run them sharing it: ``SYMMSYNC_SHARE_GPUS=1``.
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
WORLD = 2


@pytest.fixture(autouse=True)
def _gpus():
    helpers.need_gpus("cuda", WORLD)
    if helpers.gpu_count() == 0:
        pytest.skip("needs an NVIDIA GPU: run on a GPU machine (SYMMSYNC_SHARE_GPUS=1 for one GPU)")


@triton.jit
def signal_kernel(sig, me, peer, slot, NSLOTS: tl.constexpr):
    ssl.signal(sig, me, peer, slot, 1, ssl.ADD, NSLOTS)


@triton.jit
def wait_kernel(sig, me, timeout_ns, record, peer, slot, value, out, SIZE: tl.constexpr, NSLOTS: tl.constexpr):
    tl.store(out, ssl.wait_signal(sig, me, peer, slot, value, ssl.EQ, timeout_ns, record, SIZE, NSLOTS, False))


def slot_past_the_end():
    buf = ss.SymmetricBuffer(4096, backend="cuda")
    view = buf.view([0, 1])
    sigs = ss.Signals(view, slots=1, timeout_s=2)
    me = view.local_index
    out = {}
    if me == 0:  # slot 1 of 1 at member 1 would be member 1's own row there: it must never land
        signal_kernel[(1,)](sigs.kernel_args[0], me, 1, 1, NSLOTS=1)
        try:
            sigs.synchronize()
            out["error"] = None
        except ss.IndexCheckError as e:
            out["error"] = (e.rank, e.primitive, e.which, e.value, e.bound)
        dist.barrier()
        return out  # the context is unusable after the trap: nothing more on this rank
    dist.barrier()
    status = torch.full((1,), -1, dtype=torch.int64, device=buf.device)
    # inbox[0][1] at member 1 is inbox[1][0] there: the slot member 1 signals itself on, never signalled
    wait_kernel[(1,)](*sigs.kernel_args, 1, 0, 1, status, SIZE=2, NSLOTS=1)
    out["status"] = int(status.item())
    out["values"] = sigs.values().tolist()
    buf.close()
    return out


@pytest.mark.traps
def test_an_index_out_of_range_traps_after_its_record_and_synchronize_raises_index_check_error():
    sender, receiver = run(slot_past_the_end, WORLD, backend="cuda")
    assert sender["error"] == (0, "signal", "slot", 1, 1), sender
    assert receiver["values"] == [[0], [0]] and receiver["status"] == 1, receiver  # nothing landed: timed out


def kept_after_close():
    buf = ss.SymmetricBuffer(4096, backend="cuda")
    view = buf.view([0, 1])
    sigs = ss.Signals(view, slots=1, timeout_s=5)
    args, peer = sigs.kernel_args, 1 - view.local_index
    status = torch.full((1,), -1, dtype=torch.int64, device=buf.device)
    wait_kernel[(1,)](*args, peer, 0, 0, status, SIZE=2, NSLOTS=1)  # EQ 0 on a fresh slot: holds
    before = int(status.item())
    sigs.close()
    wait_kernel[(1,)](*args, peer, 0, 0, status, SIZE=2, NSLOTS=1)  # the same wait, kept arguments
    after = int(status.item())
    dist.barrier()
    buf.close()
    return before, after


def test_a_wait_through_kept_arguments_of_a_closed_signals_returns_2_whatever_the_slot_holds():
    for out in run(kept_after_close, WORLD, backend="cuda"):
        assert out == (0, 2), out
