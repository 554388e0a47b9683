"""symmsync.moe on GPUs: the host suite's oracles, eagerly, in CUDA-graph replay and compiled.

Marker ``gpu``: skipped where fewer than 2 GPUs exist, unless ``SYMMSYNC_SHARE_GPUS=1`` (the
ranks then share the GPUs there are: a smoke run on one GPU). The oracle is tests/moe's
(``moe_oracle.py``: plain torch loops written from docs/moe.md's contract), run on CPU copies
of every member's inputs; results are compared bit for bit (the combine's kernel is built
without fused multiply-add, so its float32 sums are the oracle's).

* every routing kind at each world of ``SYMMSYNC_GPU_WORLDS`` (default 2), bfloat16, and the fp8
  option's codes and scales;
* 200 back-to-back layers with a random delay on one member, checked after the loop;
* one layer captured in a CUDA graph and replayed 100 times on fresh routings copied into the
  graph's inputs (the step counters and counted waits advance on the device), every replay
  checked;
* a layer compiled with ``torch.compile(fullgraph=True)`` (Inductor) against the eager layer.
"""

import random
import sys
import time
from pathlib import Path

import helpers
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import moe
from symmsync.testing import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "moe"))
import moe_oracle as oracle  # noqa: E402
import routings  # noqa: E402

pytestmark = pytest.mark.gpu
WORLDS = helpers.gpu_worlds()  # SYMMSYNC_GPU_WORLDS; make test-gpu-shared: 2, 4 and 8 ranks on one GPU
E, M, H, K = 8, 16, 256, 4


def _gathered(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x.cpu())
    return out


def _make(fp8=False):
    world = dist.get_world_size()
    buf = ss.SymmetricBuffer(moe.buffer_bytes(E, M, H, torch.bfloat16, K, world, fp8=fp8), backend="cuda")
    return buf, moe.Dispatcher(buf.view(list(range(world))), E, M, H, torch.bfloat16, K, fp8=fp8, timeout_s=60)


def _experts(disp, recv):
    first = disp.view.local_index * disp.local_experts
    return torch.stack([oracle.expert(recv[e], first + e) for e in range(disp.local_experts)])


def _check(disp, x, ids, w, recv, handle, y, me):
    xs, all_ids = _gathered(x), _gathered(ids)
    rows, src, fill = oracle.dispatch(xs, all_ids, E, M, me)
    n = fill.sum(1)
    ok = oracle.same_bits(oracle.received(recv.cpu(), n), rows)
    ok = ok and torch.equal(oracle.received(handle.src.cpu(), n, -1), src)
    ok = ok and torch.equal(handle.per_source.cpu(), fill) and torch.equal(handle.offsets.cpu(), fill.cumsum(1) - fill)
    return ok and oracle.same_bits(y.cpu(), oracle.combine(x.cpu(), ids.cpu(), w.cpu()))


def _routings():
    me, world = dist.get_rank(), dist.get_world_size()
    buf, disp = _make()
    dev = buf.device
    wrong = []
    for i, kind in enumerate(routings.KINDS):
        x, ids, w = (t.to(dev) for t in routings.routing(kind, me, world, E, M, H, K, torch.bfloat16, i))
        recv, counts, handle = disp.dispatch(x, ids)
        y = disp.combine(_experts(disp, recv), w, handle)
        disp.synchronize()
        if not _check(disp, x, ids, w, recv, handle, y, me):
            wrong.append(kind)
    buf.close()
    return wrong


def _fp8():
    me, world = dist.get_rank(), dist.get_world_size()
    buf, disp = _make(fp8=True)
    x, ids, _ = (t.to(buf.device) for t in routings.routing("random", me, world, E, M, H, K, torch.bfloat16, 3))
    (codes, scales), counts, handle = disp.dispatch(x, ids)
    disp.synchronize()
    q = [oracle.quantize(v) for v in _gathered(x)]
    all_ids = _gathered(ids)
    rows, _, fill = oracle.dispatch([c for c, _ in q], all_ids, E, M, me)
    want_s, _, _ = oracle.dispatch([s for _, s in q], all_ids, E, M, me)
    n = fill.sum(1)
    ok = torch.equal(oracle.received(codes.view(torch.uint8).cpu(), n), rows)
    ok = ok and oracle.same_bits(oracle.received(scales.cpu(), n), want_s)
    buf.close()
    return ok


def _layers(n):
    me, world = dist.get_rank(), dist.get_world_size()
    buf, disp = _make()
    dev = buf.device
    rng = random.Random(me)
    kept = []
    for i in range(n):
        x, ids, w = (t.to(dev) for t in routings.routing(routings.KINDS[i % 6], me, world, E, M, H, K,
                                                          torch.bfloat16, i))  # fmt: skip
        if me == 1 and rng.random() < 0.2:
            time.sleep(0.002)
        recv, counts, handle = disp.dispatch(x, ids)
        y = disp.combine(_experts(disp, recv), w, handle)
        kept.append((x, ids, w, recv.clone(), handle._replace(src=handle.src.clone()), y))  # views: until 2 on
    disp.synchronize()
    wrong = [i for i, k in enumerate(kept) if not _check(disp, *k, me)]
    buf.close()
    return wrong


def _replayed(replays, make_step, tokens=M - 1, seed=1000):
    """A layer captured in a CUDA graph (``make_step(disp, x, ids, w, outs)`` returns its step, which
    leaves ``(recv, handle, y)`` in ``outs["r"]``) and replayed on fresh routings of ``tokens`` tokens
    (one token count, fixed for the graph): the replays whose results differ from the oracle's."""
    me, world = dist.get_rank(), dist.get_world_size()
    buf, disp = _make()
    dev = buf.device
    x, ids, w = (t.to(dev)[:tokens] for t in routings.routing("random", me, world, E, M, H, K, torch.bfloat16, 0))
    outs = {}
    g = helpers.capture(make_step(disp, x, ids, w, outs))
    wrong = []
    for i in range(replays):
        nx, nids, nw = routings.routing("random", me, world, E, M, H, K, torch.bfloat16, seed + i)
        x.copy_(nx[:tokens].to(dev)), ids.copy_(nids[:tokens].to(dev)), w.copy_(nw[:tokens].to(dev))
        g.replay()
        disp.synchronize()
        recv, handle, y = outs["r"]
        if not _check(disp, x, ids, w, recv, handle, y, me):
            wrong.append(i)
    buf.close()
    return wrong


def _plain_step(disp, x, ids, w, outs):
    def step():
        recv, counts, handle = disp.dispatch(x, ids)
        outs["r"] = (recv, handle, disp.combine(_experts(disp, recv), w, handle))

    return step


def _overlapped_step(disp, x, ids, w, outs):
    """Sends launched with wait=False, a GEMM launched before each wait()."""
    a = torch.randn(256, 256, device=x.device)

    def step():
        pending = disp.dispatch(x, ids, wait=False)
        outs["work"] = a @ a  # launched between the send and the receive
        recv, counts, handle = pending.wait()
        pending = disp.combine(_experts(disp, recv), w, handle, wait=False)
        outs["work2"] = outs["work"] @ a
        outs["r"] = (recv, handle, pending.wait())

    return step


def _compiled():
    me, world = dist.get_rank(), dist.get_world_size()
    buf, disp = _make()
    dev = buf.device

    def step(x, ids, w):
        recv, counts, handle = disp.dispatch(x, ids)
        return disp.combine((recv.float() * 0.5).to(torch.bfloat16), w, handle)

    compiled = torch.compile(step, fullgraph=True)
    wrong = []
    for i in range(4):
        x, ids, w = (t.to(dev) for t in routings.routing(routings.KINDS[i], me, world, E, M, H, K, torch.bfloat16, i))
        if not torch.equal(compiled(x, ids, w).view(torch.int16), step(x, ids, w).view(torch.int16)):
            wrong.append(i)
    disp.synchronize()
    buf.close()
    return wrong


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request):
    helpers.need_gpus("cuda", request.param)
    return request.param


def test_every_routing_matches_the_oracle_on_gpus(world):
    assert run(_routings, world, backend="cuda", timeout_s=600) == [[]] * world


def test_fp8_codes_and_scales_match_the_rule_on_gpus(world):
    got = run(_fp8, world, backend="cuda", timeout_s=600)
    assert [r for r, ok in enumerate(got) if ok is not True] == [], f"ranks whose codes or scales differ: {got}"


def test_200_back_to_back_layers_are_exact_on_gpus(world):
    assert run(_layers, world, 200, backend="cuda", timeout_s=900) == [[]] * world


def test_a_captured_layer_replays_exactly_on_fresh_routings(world):
    # A hang here fails in 5 minutes, naming the ranks that never finished: under MPS at world 4 one
    # device call's limit ran out inside this test once (benchmarks/results/raw/mps_gpu_suite_h200x1_part2.txt).
    assert run(_replayed, world, 100, _plain_step, backend="cuda", timeout_s=300) == [[]] * world


def test_a_compiled_layer_gives_the_eager_bits_on_gpus(world):
    assert run(_compiled, world, backend="cuda", timeout_s=900) == [[]] * world


def test_a_layer_with_wait_false_and_work_between_replays_exactly(world):
    assert run(_replayed, world, 20, _overlapped_step, M, 2000, backend="cuda", timeout_s=300) == [[]] * world
