"""Creation during CUDA graph capture fails clearly, on a real capture (one GPU is enough).

Rank 1 captures a CUDA graph and, inside the capture, creates a buffer (every
constructor), a view and a fence, and grows a buffer; rank 0 makes the same calls at the
same time without capturing. Every collective call raises ``CaptureError`` naming rank 1
on both ranks; the fence (not collective) is refused on rank 1 only. The capture is not
left broken: the work captured around the refusals replays, and the stream fences after.

Marker ``gpu``: 2 ranks, on 2 GPUs or sharing one (``SYMMSYNC_SHARE_GPUS=1``, collectives
on gloo); skipped where no GPU exists.
"""

import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2


def _outcome(make):
    try:
        make()
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e)
    except Exception as e:  # noqa: BLE001 - a raw error is what the test must not see
        return "raw " + type(e).__name__, str(e)
    return "made", ""


def create_during_capture():
    me = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = ss.SymmetricBuffer(1 << 16, backend="cuda")
    growable = ss.SymmetricBuffer(1 << 21, backend="cuda", max_nbytes=1 << 23)
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=30)
    fence.fence()
    ptrs = buf.ptrs.tolist()  # read before the capture: a copy to the host is not capturable
    local = torch.zeros(1 << 16, dtype=torch.uint8, device=dev)
    x = torch.zeros(16, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    calls = {
        "SymmetricBuffer": lambda: ss.SymmetricBuffer(1 << 16, backend="cuda"),
        "SymmetricBuffer.register": lambda: ss.SymmetricBuffer.register(local),
        "SymmetricBuffer.from_peer_addresses": lambda: ss.SymmetricBuffer.from_peer_addresses(
            ptrs, 1 << 16, device=dev
        ),
        "view": lambda: buf.view([0, 1]),
        "SymmetricBuffer.grow": lambda: growable.grow(1 << 22),
    }
    out = {}
    g = torch.cuda.CUDAGraph()
    if me == 1:
        with torch.cuda.graph(g):
            x.add_(1)
            for name, call in calls.items():
                out[name] = _outcome(call)
            out["Fence"] = _outcome(lambda: ss.Fence(view, timeout_s=30))
            x.add_(1)
    else:
        for name, call in calls.items():
            out[name] = _outcome(call)
        out["Fence"] = _outcome(lambda: ss.Fence(view, timeout_s=30))
        x.add_(2)
    torch.cuda.synchronize()
    if me == 1:
        g.replay()  # the capture is whole: both adds replay
        g.replay()
    torch.cuda.synchronize()
    out["x"] = x.tolist()
    out["nbytes"] = growable.nbytes
    fence.fence()  # the stream and the view still work
    out["epoch"] = fence.epoch
    growable.close()
    buf.close()
    return out


def test_creating_during_capture_raises_capture_error_on_every_rank_and_leaves_the_capture_whole():
    for rank, out in enumerate(run(create_during_capture, WORLD, backend="cuda", dist_backend="gloo")):
        for name in ("SymmetricBuffer", "SymmetricBuffer.register", "SymmetricBuffer.from_peer_addresses", "view"):
            kind, msg = out[name]
            assert kind == "CaptureError" and msg.startswith(f"{name}: rank 1: called while a CUDA graph"), (name, out)
        kind, msg = out["SymmetricBuffer.grow"]
        assert kind == "CaptureError" and "rank 1" in msg, out
        if rank == 1:
            assert out["Fence"][0] == "CaptureError" and "Create fences before capture" in out["Fence"][1], out
            assert out["x"] == [5.0] * 16, out  # warm-up 1, then 2 replays of 2 adds
        else:
            assert out["Fence"][0] == "made", out
            assert out["x"] == [3.0] * 16, out
        assert out["nbytes"] == 1 << 21 and out["epoch"] == 2, out
