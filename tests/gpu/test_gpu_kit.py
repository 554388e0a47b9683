"""The consumer kit on GPUs: no plausible stale output after a failed call, eagerly and in graph replay.

Marker ``gpu``: skipped where fewer than 2 GPUs exist, unless ``SYMMSYNC_SHARE_GPUS=1`` (the ranks
then share the GPUs there are). On a GPU a call returns before its kernel ran, so a peer's refusal
is known on the device first. The oracles, written here in plain torch:

* the tutorial's all-to-all (examples/11_all_to_all.py, a consumer written on the public API only):
  the last member passes a float64 input; before any synchronization, every other member's output
  of that call is all NaN and its status word reads 1 (refused); its ``synchronize()`` raises
  ``PeerRefused`` naming the last member and its reason, once; the status word reads 0 after; the
  next call delivers every member's blocks. Members whose sizes differ: status word 2, NaN,
  ``CallMismatch`` at ``synchronize()``, no trap (the buffer closes normally).
* the MoE dispatcher in CUDA-graph replay: a layer captured once, replayed on fresh routings; on one
  replay the last member's ids hold an expert id out of range (found by its send kernel): every
  member's counts of that replay are 0 and every combine output is NaN (the combine of a failed
  dispatch's handle, never the rows of the replay before), the status word reads 1;
  ``synchronize()`` raises (``InputError`` on the last member, ``PeerRefused`` elsewhere); the next
  replay, on good ids, is right.
"""

import importlib.util
import sys
from pathlib import Path

import helpers
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import moe
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLDS = helpers.gpu_worlds()
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4


def _tutorial():
    name = "tutorial_all_to_all"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "11_all_to_all.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _blocks(me, w, call, device):
    return torch.tensor([1000.0 * me + 10.0 * p + call for p in range(w) for _ in range(BLOCK)], device=device)


def _received(me, w, call):
    return torch.cat([_blocks(p, w, call, "cpu")[me * BLOCK : (me + 1) * BLOCK] for p in range(w)])


def all_to_all_failures():
    me, w = dist.get_rank(), dist.get_world_size()
    bad = w - 1
    buf = ss.SymmetricBuffer(1 << 16, backend="cuda")
    a2a = _tutorial().AllToAll(buf.view(list(range(w))), 16)
    d = buf.device
    out = {"first": torch.equal(a2a(_blocks(me, w, 0, d)).cpu(), _received(me, w, 0))}
    y = torch.full((w * BLOCK,), 7.0, device=d)
    x = _blocks(me, w, 1, d)
    out["refusal"] = helpers.raised(a2a, x.double() if me == bad else x, y)
    out["status"] = int(a2a.status)  # what a runtime's copy sees, before any synchronize()
    out["nan"] = bool(y.isnan().all().item())
    out["sync"] = helpers.raised(a2a.synchronize)
    out["again"] = helpers.raised(a2a.synchronize)
    out["after"] = int(a2a.status)
    out["next"] = torch.equal(a2a(_blocks(me, w, 2, d)).cpu(), _received(me, w, 2))
    a2a.synchronize()
    z = a2a(torch.zeros(w * (BLOCK + (me == bad)), device=d))  # sizes that differ
    out["mismatch_status"] = int(a2a.status)
    out["mismatch_nan"] = bool(z.isnan().all().item())
    out["mismatch"] = helpers.raised(a2a.synchronize)
    a2a.close()  # the view failed on no member: close() is collective and returns; no trap happened
    buf.close()
    return out


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request):
    helpers.need_gpus("cuda", request.param)
    return request.param


def test_a_refused_call_of_a_consumer_of_your_own_leaves_nan_and_says_so_before_synchronize(world):
    results = run(all_to_all_failures, world, backend="cuda", timeout_s=300)
    bad = world - 1
    for r, res in enumerate(results):
        assert res["first"] and res["next"], (r, res)
        if r == bad:
            assert res["refusal"][0] == "InputError" and "x must be torch.float32" in res["refusal"][1], res
            assert res["status"] == 0 and res["sync"][0] == "returned", res  # its own refusal raised at once
        else:
            assert res["refusal"][0] == "returned" and res["status"] == 1 and res["nan"], (r, res)
            assert res["sync"][0] == "PeerRefused" and res["sync"][2] == bad, (r, res)
            assert "x must be torch.float32, got torch.float64" in res["sync"][1], (r, res)
        assert res["again"][0] == "returned" and res["after"] == 0, (r, res)
        assert res["mismatch_status"] == 2 and res["mismatch_nan"], (r, res)
        assert res["mismatch"][0] == "CallMismatch", (r, res)


E, M, H, K = 8, 16, 256, 4


def moe_replays_with_a_bad_id():
    me, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    ne = E * world
    buf = ss.SymmetricBuffer(moe.buffer_bytes(ne, M, H, torch.bfloat16, K, world), backend="cuda")
    d = buf.device
    disp = moe.Dispatcher(buf.view(list(range(world))), ne, M, H, torch.bfloat16, K, timeout_s=60)
    g = torch.Generator().manual_seed(me)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16).to(d)
    ids = torch.stack([torch.randperm(ne, generator=g)[:K] for _ in range(M)]).to(d)
    good_ids = ids.clone()
    w = torch.rand(M, K, generator=g).to(d)
    outs = {}

    def step():
        recv, counts, handle = disp.dispatch(x, ids)
        outs["counts"], outs["recv"] = counts, recv
        outs["y"] = disp.combine((recv.float() * 2).to(torch.bfloat16), w, handle)

    graph = helpers.capture(step)
    want = (w.float().sum(1, keepdim=True) * (2 * x.float())).to(torch.bfloat16).float()  # every expert doubles
    seen = []
    for replay in range(3):
        ids.copy_(good_ids)
        if replay == 1 and me == bad:
            ids[0, 1] = ne  # no expert id: the send kernel refuses the step
        graph.replay()
        status = int(disp.status)
        counts = outs["counts"].tolist()
        y = outs["y"].float()
        nan = bool(y.isnan().all().item()) and bool(outs["recv"].isnan().all().item())  # before synchronize()
        right = bool(torch.allclose(y, want, rtol=2e-2, atol=2e-2))
        sync = helpers.raised(disp.synchronize)
        seen.append({"status": status, "counts": counts, "nan": nan, "right": right, "sync": sync})
    buf.close()
    return seen


def test_a_refused_step_in_graph_replay_leaves_zero_counts_and_nan_and_the_next_replay_is_right(world):
    bad = world - 1
    for r, seen in enumerate(run(moe_replays_with_a_bad_id, world, backend="cuda", timeout_s=300)):
        for i in (0, 2):
            assert seen[i]["right"] and seen[i]["status"] == 0 and seen[i]["sync"][0] == "returned", (r, i, seen)
        refused = seen[1]
        assert refused["status"] == 1 and refused["nan"] and not any(refused["counts"]), (r, refused)
        kind = "InputError" if r == bad else "PeerRefused"
        assert refused["sync"][0] == kind and "is no expert id" in refused["sync"][1], (r, refused)
