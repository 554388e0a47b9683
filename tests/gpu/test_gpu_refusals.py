"""A refused call on GPUs: it fails that call on every member, traps nowhere, and the next call is right.

Marker ``gpu``: skipped where fewer than 2 GPUs exist, unless ``SYMMSYNC_SHARE_GPUS=1`` (the
ranks then share the GPUs there are). The host suite proves the behaviour and its bites under the
interpreter (tests/collectives/test_collective_faults.py, tests/moe/test_moe_fail_closed.py);
here the same contract runs on the device, where a refused header read by a compiled kernel must
neither trap nor leave a counter counted:

* collectives: the last member passes a bad argument (too many elements, a float64 input to a
  two-shot all-reduce, a split the view cannot divide), the others the good call; the bad member
  raises ``InputError``, the others ``PeerRefused`` naming it; after each, an all-reduce, an
  all-gather and a reduce-scatter on every member match the members' sum and concatenation,
  written as plain torch;
* MoE: the last member passes an expert id out of range (found on the device, not on the host),
  or more tokens than ``max_tokens``; the same errors; after each, a layer whose combine equals
  ``sum_k w[t, k] * 2 * x[t]`` for an expert that doubles its rows (plain torch);
* the direct-KV writer (the direct route's fused tail, and the all-gather route, whose refused
  block's header the kernel reads): the last member writes a layer with a float32 ``kv_c``, or
  a layer out of range; it raises at once, the others' writes return and their
  ``synchronize()`` raises ``PeerRefused`` naming it; then every member writes the next layer,
  and every replica holds every member's rows (tests/oracles.py: plain torch from the format
  rules).

On every member whose call returned, before anything settles the host, the refused call's output
is read on the device: a collective's all NaN, a dispatch's counts all zero (the writer's slots
cannot be known), and the consumer's status word reads 1.
"""

import helpers
import pytest
import torch
import torch.distributed as dist
from oracles import Cache, first_difference, prompt

import symmsync as ss
from symmsync import collectives as C
from symmsync import moe, pcp
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLDS = helpers.gpu_worlds()
N = 4096


COLLECTIVE_CASES = {
    # name: (the bad member's call, the others' call, words of the bad member's InputError)
    "too_many": (lambda ar, ag, rs, d: ar(torch.ones(N + 1, device=d)),
                 lambda ar, ag, rs, d: ar(torch.ones(8, device=d)),
                 f"max_numel={N}"),
    "two_shot_dtype": (lambda ar, ag, rs, d: ar(torch.ones(N // 2, device=d).double(), algorithm="two_shot"),
                       lambda ar, ag, rs, d: ar(torch.ones(N // 2, device=d), algorithm="two_shot"),
                       "x must be float32, bfloat16 or float16"),
    "scatter_split": (lambda ar, ag, rs, d: rs(torch.ones(7, device=d)),
                      lambda ar, ag, rs, d: rs(torch.ones(6 * dist.get_world_size(), device=d)),
                      "not a multiple of the view's"),
}  # fmt: skip


def _refused_call(call, args, op, settle, name, wrong, poisoned=lambda out: bool(out.isnan().all())):
    """What ``call(*args)`` did, as helpers.raised tells it. Where it returned (the members that made
    the good call), its output and ``op``'s status word are read on the device before anything
    settles the host: the output must be ``poisoned`` (NaN) and the status word 1 (a member
    refused); then each of ``settle`` synchronizes, where the peer's refusal is raised."""
    try:
        out = call(*args)
    except ss.SymmSyncError as e:
        return (type(e).__name__, str(e), getattr(e, "origin", None))
    torch.cuda.synchronize()
    status = int(op.status.item())
    if not poisoned(out):
        wrong.append(f"{name}: the refused call's output was readable before synchronize()")
    if status != 1:
        wrong.append(f"{name}: the status word read {status} before synchronize(), not 1")
    return helpers.raised(lambda: [o.synchronize() for o in settle])


def _collectives():
    world, rank = dist.get_world_size(), dist.get_rank()
    per = C.workspace_bytes(N, torch.float32, world)
    buf = ss.SymmetricBuffer(3 * per, backend="cuda")
    d = buf.device
    view = buf.view(list(range(world)))
    ar = C.AllReduce(view, N, torch.float32, "auto", timeout_s=60)
    ag = C.AllGather(view, N, torch.float32, offset=per, channel=1, timeout_s=60)
    rs = C.ReduceScatter(view, N, torch.float32, offset=2 * per, channel=2, timeout_s=60)
    seen, wrong = {}, []
    for i, (name, (bad, good, _)) in enumerate(COLLECTIVE_CASES.items()):
        seen[name] = _refused_call(
            bad if rank == world - 1 else good,
            (ar, ag, rs, d),
            rs if name == "scatter_split" else ar,
            (ar, ag, rs),
            name,
            wrong,
        )
        torch.cuda.synchronize()
        x = torch.full((6 * world,), float(rank + 1 + i), device=d)
        total = sum(float(r + 1 + i) for r in range(world))
        want_ag = torch.tensor([float(r + 1 + i) for r in range(world) for _ in range(6 * world)])
        try:
            if not bool((ar(x) == total).all()):
                wrong.append(f"after {name}: the all-reduce")
            if not torch.equal(ag(x).cpu(), want_ag):
                wrong.append(f"after {name}: the all-gather")
            if not bool((rs(x) == total).all()):
                wrong.append(f"after {name}: the reduce-scatter")
            torch.cuda.synchronize()
        except ss.SymmSyncError as e:
            wrong.append(f"after {name}: {type(e).__name__}: {str(e)[:200]}")
            break
    buf.close()
    return seen, wrong


E, M, H, K = 8, 16, 256, 2


def _moe_cases(world):
    ne = E * world
    return {
        # name: (the bad member's (x, ids), words of its InputError)
        "expert": (lambda x, ids: (x, ids.index_fill(1, torch.tensor([1], device=ids.device), ne)),
                   f"topk_idx[0, 1] = {ne} is no expert id"),
        "tokens": (lambda x, ids: (torch.zeros(M + 1, H, dtype=x.dtype, device=x.device),
                                   torch.zeros(M + 1, K, dtype=ids.dtype, device=ids.device)),
                   f"more than max_tokens={M}"),
    }  # fmt: skip


def _moe():
    me, world = dist.get_rank(), dist.get_world_size()
    ne = E * world
    buf = ss.SymmetricBuffer(moe.buffer_bytes(ne, M, H, torch.bfloat16, K, world), backend="cuda")
    d = buf.device
    disp = moe.Dispatcher(buf.view(list(range(world))), ne, M, H, torch.bfloat16, K, timeout_s=60)
    seen, wrong = {}, []
    for i, (name, (change, _)) in enumerate(_moe_cases(world).items()):
        g = torch.Generator(device="cpu").manual_seed(100 * i + me)
        x = torch.randn(M, H, generator=g).to(torch.bfloat16).to(d)
        ids = torch.stack([torch.randperm(ne, generator=g)[:K] for _ in range(M)]).to(d)
        args = change(x, ids) if me == world - 1 else (x, ids)
        # A refused dispatch's outputs: zero rows from every source (recv is then not to be read).
        seen[name] = _refused_call(disp.dispatch, args, disp, (disp,), name, wrong,
                                   poisoned=lambda out: int(out[1].sum()) == 0)  # fmt: skip
        torch.cuda.synchronize()
        w = torch.rand(M, K, generator=g).to(d)
        try:
            recv, counts, handle = disp.dispatch(x, ids)
            y = disp.combine((recv.float() * 2).to(torch.bfloat16), w, handle)
            disp.synchronize()
        except ss.SymmSyncError as e:
            wrong.append(f"after {name}: {type(e).__name__}: {str(e)[:200]}")
            break
        # Every expert doubles its rows (exact in bfloat16); the combine sums in float32.
        want = (w.float().sum(1, keepdim=True) * (2 * x.float())).to(torch.bfloat16)
        got = y.float()
        if not torch.allclose(got, want.float(), rtol=2e-2, atol=2e-2):
            wrong.append(f"after {name}: the next layer's combine, max diff {(got - want.float()).abs().max().item()}")
    buf.close()
    return seen, wrong


WRITER_CASES = {
    "dtype": (lambda a: (a[0], a[1].float(), *a[2:]), "bfloat16"),
    "layer": (lambda a: (5, *a[1:]), "layer 5 is out of range"),
}


def _writer(route):
    world, rank = dist.get_world_size(), dist.get_rank()
    cache = Cache(1, 2, 64)
    buf = ss.SymmetricBuffer(cache.end, backend="cuda")
    d = buf.device
    writer = pcp.DirectKVWriter(buf.view(list(range(world))), cache.layout, route=route, timeout_s=60)
    split = pcp.pcp_split(12, world)
    seen, wrong = {}, []
    for i, (name, (change, _)) in enumerate(WRITER_CASES.items()):
        kv, pe, ix, slots = prompt(100 + i, 12, 64)
        rows = [split.local_rows(t, rank).contiguous().to(d) for t in (kv, pe, ix)]
        batch = writer.prepare(split.local_slots(slots, rank).to(d))
        buf.tensor(0, (cache.end,), torch.uint8).zero_()
        torch.cuda.synchronize()
        dist.barrier()  # every replica cleared before anyone writes into it
        good = (0, *rows, batch)
        args = change(good) if rank == world - 1 else good
        # Which slots the refusing member's rows were for cannot be known: the status word says so.
        seen[name] = _refused_call(writer.write, args, writer, (writer,), name, wrong,
                                   poisoned=lambda out: True)  # fmt: skip
        try:
            writer.write(1, *rows, batch)
            writer.synchronize()
        except ss.SymmSyncError as e:
            wrong.append(f"after {name}: {type(e).__name__}: {str(e)[:200]}")
            break
        diff = first_difference(cache.raw_layer(buf, 1), cache.expected_layer(kv, pe, ix, slots, fill=0))
        if diff != (0, []):
            wrong.append(f"after {name}: layer 1 of this replica differs from the reference: {diff}")
        dist.barrier()
    buf.close()
    return seen, wrong


def _check(results, cases, kind, errors=None):
    world = len(results)
    bad = world - 1
    for r, (_, wrong) in enumerate(results):
        assert wrong == [], f"rank {r}: the calls after a refused one: {wrong[:4]}"
    for name, case in cases.items():
        words = case[-1]
        mine = results[bad][0][name]
        assert mine[0] == (errors or {}).get(name, "InputError") and words in mine[1], (name, mine)
        for r in range(bad):
            theirs = results[r][0][name]
            assert theirs[0] == "PeerRefused" and theirs[2] == bad, (name, r, theirs)
            assert f"rank {bad} refused its {kind}" in theirs[1], (name, r, theirs)


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request):
    helpers.need_gpus("cuda", request.param)
    return request.param


def test_a_refused_collective_call_fails_once_on_every_member_and_the_next_calls_are_right(world):
    _check(run(_collectives, world, backend="cuda", timeout_s=300), COLLECTIVE_CASES, "call")


def test_a_refused_dispatch_fails_once_on_every_member_and_the_next_layer_is_right(world):
    _check(run(_moe, world, backend="cuda", timeout_s=300), _moe_cases(world), "dispatch")


@pytest.mark.parametrize("route", ["direct", "allgather"])
def test_a_refused_write_fails_once_on_every_member_and_the_next_layer_is_right(world, route):
    results = run(_writer, world, route, backend="cuda", timeout_s=300)
    _check(results, WRITER_CASES, "write", {"layer": "BoundsError"})
