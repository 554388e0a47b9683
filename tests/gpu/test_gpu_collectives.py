"""symmsync.collectives on GPUs: every operation and algorithm, eagerly and in CUDA-graph replay.

Marker ``gpu``: skipped where fewer than 2 GPUs exist, unless ``SYMMSYNC_SHARE_GPUS=1``
(the ranks then share the GPUs there are: a smoke run on one GPU). The oracle is the
one of tests/collectives/test_collectives.py, written again here (test modules do not
import each other): every member's inputs gathered with torch.distributed and summed
in member order in float32 (``acc = x_0; acc += x_1; ...``, one rounding to the dtype);
``torch.cat`` for the all-gather. Results are compared bit for bit.
"""

import os
import random

import helpers
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2  # the tests that do not scale with the world
WORLDS = helpers.gpu_worlds()  # SYMMSYNC_GPU_WORLDS; make test-gpu-shared: 2, 4 and 8 ranks on one GPU
MAX_NUMEL = 1 << 21
OPS = ("one_shot", "two_shot", "auto", "all_gather", "reduce_scatter")


def _expected(op, inputs, rank):
    if op == "all_gather":
        return torch.cat(inputs)
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    total = acc.to(inputs[0].dtype)
    if op == "reduce_scatter":
        k = inputs[0].numel() // len(inputs)
        return total[rank * k : (rank + 1) * k]
    return total


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _gathered(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x.cpu())
    return out


def _objects():
    world = dist.get_world_size()
    per = C.workspace_bytes(MAX_NUMEL, torch.float32, world)
    buf = ss.SymmetricBuffer(3 * per, backend="cuda")
    view = buf.view(list(range(world)))
    ops = {
        "all_reduce": C.AllReduce(view, MAX_NUMEL, torch.float32, timeout_s=60),
        "all_gather": C.AllGather(view, MAX_NUMEL, torch.float32, offset=per, channel=1, timeout_s=60),
        "reduce_scatter": C.ReduceScatter(view, MAX_NUMEL, torch.float32, offset=2 * per, channel=2, timeout_s=60),
    }
    return buf, ops


def _call(ops, op, x, out=None, symmetric=False):
    target = ops["all_reduce"] if op in ("one_shot", "two_shot", "auto") else ops[op]
    if symmetric:
        t = target.input(x.numel(), x.dtype)
        t.copy_(x)
        x = t
    if target is ops["all_reduce"]:
        return target(x, out, algorithm=op)
    return target(x, out)


def eager_back_to_back(sizes, dtypes, calls_each):
    """Rank function: every (op, dtype, size, input kind) ``calls_each`` times back to back, fresh
    inputs each call, no host barrier; the cases that differ from the oracle, after the loop."""
    buf, ops = _objects()
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device=buf.device).manual_seed(rank)
    done = []
    for op in OPS:
        for dtype in dtypes:
            for n in sizes:
                n = max(size, n // size * size) if op == "reduce_scatter" else n
                for k in range(calls_each):
                    sym = k % 3 == 2
                    x = torch.randn(n, generator=g, device=buf.device).to(dtype)
                    done.append(((op, str(dtype), n, sym), x, _call(ops, op, x, symmetric=sym).clone()))
    ops["all_reduce"].synchronize()
    torch.cuda.synchronize()
    wrong = sorted({case for case, x, y in done if not _same(y.cpu(), _expected(case[0], _gathered(x), rank))})
    buf.close()
    return wrong


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request):
    helpers.need_gpus("cuda", request.param)
    return request.param


def test_every_operation_and_algorithm_matches_the_oracle_eagerly_back_to_back(world):
    # Past 2 members the largest size and a dtype go: the oracle gathers every input over gloo.
    sizes = (1, 777, 4096 + 3, 1 << 16, MAX_NUMEL) if world <= 2 else (1, 777, 4096 + 3, 1 << 16)
    dtypes = (torch.bfloat16, torch.float32, torch.float16) if world <= 2 else (torch.bfloat16, torch.float32)
    for rank, wrong in enumerate(run(eager_back_to_back, world, sizes, dtypes, 4, backend="cuda", timeout_s=600)):
        assert wrong == [], f"rank {rank}: cases that differ from the oracle: {wrong}"


def graph_batches(cases, numel, batches, per_batch):
    """Rank function: for each ``(op, symmetric)`` of ``cases``, one call captured in a CUDA graph
    over static tensors; per batch, fresh inputs, ``per_batch`` replays back to back, then the
    output's bytes against the oracle. ``{case: [batch matched, ...]}``."""
    buf, ops = _objects()
    rank, size = dist.get_rank(), dist.get_world_size()
    logs = {}
    for op, symmetric in cases:
        target = ops["all_reduce"] if op in ("one_shot", "two_shot", "auto") else ops[op]
        if symmetric:
            x = target.input(numel, torch.bfloat16)
        else:
            x = torch.empty(numel, dtype=torch.bfloat16, device=buf.device)
        n_out = {"all_gather": size * numel, "reduce_scatter": numel // size}.get(op, numel)
        out = torch.empty(n_out, dtype=torch.bfloat16, device=buf.device)
        x.copy_(torch.randn(numel, device=buf.device))
        graph = helpers.capture(lambda: _call(ops, op, x, out))  # noqa: B023 - captured now, in this iteration
        log = logs[f"{op}/{'symmetric_input' if symmetric else 'copied_in'}"] = []
        for b in range(batches):
            g = torch.Generator(device=buf.device).manual_seed(1000 * b + rank)
            torch.cuda.synchronize()
            dist.barrier()  # every member finished reading the inputs of the last batch
            x.copy_(torch.randn(numel, generator=g, device=buf.device).to(torch.bfloat16))
            torch.cuda.synchronize()
            dist.barrier()
            for _ in range(per_batch):
                graph.replay()
            target.synchronize()
            log.append(_same(out.cpu(), _expected(op, _gathered(x), rank)))
        del graph
    buf.close()
    return logs


def test_every_operation_in_cuda_graph_replay_keeps_the_oracle_after_every_batch(world):
    """Every operation and algorithm, its input copied in or already symmetric, in one run of the
    ranks (starting them is most of the time at 8 ranks on one GPU)."""
    numel = 8192 * world  # 16 KB of bfloat16 per member and more: a decode-sized message
    cases = [(op, sym) for op in OPS for sym in (False, True)]
    for rank, logs in enumerate(run(graph_batches, world, cases, numel, 5, 200, backend="cuda", timeout_s=600)):
        bad = {case: log for case, log in logs.items() if log != [True] * 5}
        assert len(logs) == len(cases) and bad == {}, f"rank {rank}: batches matching the oracle: {bad or logs}"


def size_mismatch_on_gpu():
    buf, ops = _objects()
    ar = ops["all_reduce"]
    ar(torch.ones(64, device=buf.device))
    out = ar(torch.ones(512 + dist.get_rank(), device=buf.device))  # returns: the mismatch is found on the device
    status = int(ar.status)  # the status word, copied as a runtime would (it waits for the call)
    nan = bool(out.isnan().all())
    try:
        ar.synchronize()
        got = "returned"
    except C.CollectiveMismatch as e:
        got = {"differs": e.differs, "msg": str(e)}
    buf.close()  # no trap: the context is usable, the collective closes like any other
    return {"got": got, "status": status, "nan": nan}


def test_a_size_mismatch_raises_collective_mismatch_at_synchronize_with_nan_and_no_trap(world):
    for r in run(size_mismatch_on_gpu, world, backend="cuda", timeout_s=300):
        assert r["status"] == 2 and r["nan"], r  # MISMATCH, the outputs poisoned before the host knew
        assert isinstance(r["got"], dict) and r["got"]["differs"] == ["numel"], r
        assert "numel: rank 0: 512, rank 1: 513" in r["got"]["msg"], r


def fused_epilogue_on_gpu(tokens, hidden, replays):
    """Rank function: the fused residual + RMS norm, eagerly and in graph replay; (new residual
    equal to torch's ``sum + residual``, largest normed difference, the same bits on every member)."""
    buf, ops = _objects()
    ar, rank = ops["all_reduce"], dist.get_rank()
    g = torch.Generator(device=buf.device).manual_seed(rank)
    shared = torch.Generator(device=buf.device).manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g, device=buf.device).to(torch.bfloat16)
    r = torch.randn(tokens, hidden, generator=shared, device=buf.device).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=shared, device=buf.device)).to(torch.bfloat16)
    y, new_r = torch.empty_like(x), torch.empty_like(x)
    graph = helpers.capture(lambda: ar(x, y, residual=r, norm_weight=w, residual_out=new_r))
    for _ in range(replays):
        graph.replay()
    ar.synchronize()
    total = _expected("one_shot", _gathered(x), rank)
    want_r = (total.float() + r.cpu().float()).to(torch.bfloat16)
    h = want_r.float()
    want_y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.cpu().float()).to(torch.bfloat16)
    both = torch.cat([y.view(torch.uint8).flatten(), new_r.view(torch.uint8).flatten()])
    everyone = _gathered(both)
    result = (
        _same(new_r.cpu(), want_r),
        float((y.cpu().float() - want_y.float()).abs().max()),
        all(torch.equal(e, everyone[0]) for e in everyone),
    )
    buf.close()
    return result


def test_the_fused_epilogue_in_graph_replay_matches_torch_on_every_member(world):
    for residual_ok, diff, same in run(fused_epilogue_on_gpu, world, 8, 4096, 100, backend="cuda", timeout_s=600):
        assert residual_ok and same, (residual_ok, same)
        assert diff <= 0.125, diff  # rsqrt and the mean's order: a rounding step of bfloat16 at most


# ---------------------------------------------------------------------- the soak
SOAK_CALLS = int(os.environ.get("SYMMSYNC_SOAK_COLLECTIVES", "3000"))


def _inputs(call, n, dtype, world, device):
    """Every member's input of call ``call``, from the call's seed: each member makes all of them,
    so the oracle needs no exchange (member ``r``'s own input is entry ``r``)."""
    out = []
    for r in range(world):
        g = torch.Generator(device=device).manual_seed(1_000_003 * call + r)
        out.append(torch.randn(n, generator=g, device=device).to(dtype))
    return out


def mixed_calls(calls, seed):
    """Rank function: ``calls`` collectives of random operation, algorithm, dtype, size and input
    kind, back to back with no host barrier, every output checked against the member-order sum
    (``torch.cat``) of inputs every member rebuilds from the call's seed. The cases that differ."""
    buf, ops = _objects()
    rank, world = dist.get_rank(), dist.get_world_size()
    pick = random.Random(seed)  # the same choices on every member: every member makes the same call
    wrong, pending = [], []
    for call in range(calls):
        op = pick.choice(OPS)
        dtype = pick.choice((torch.bfloat16, torch.float32, torch.float16))
        n = pick.choice((1, 7, 777, 4096 + 3, 1 << 14, 1 << 16))
        n = max(world, n // world * world) if op == "reduce_scatter" else n
        sym = pick.random() < 0.3
        xs = _inputs(call, n, dtype, world, buf.device)
        pending.append(((call, op, str(dtype), n, sym), xs, _call(ops, op, xs[rank], symmetric=sym).clone()))
        if len(pending) == 100 or call == calls - 1:
            for case, inputs, got in pending:
                if not _same(got, _expected(case[1], inputs, rank)):
                    wrong.append(case)
            pending = []
    ops["all_reduce"].synchronize()
    torch.cuda.synchronize()
    dist.barrier()
    buf.close()
    return wrong


@pytest.mark.soak
def test_thousands_of_mixed_calls_at_the_largest_world_all_match_the_oracle():
    world = max(WORLDS)
    helpers.need_gpus("cuda", world)
    for rank, wrong in enumerate(run(mixed_calls, world, SOAK_CALLS, 7, backend="cuda", timeout_s=900)):
        assert wrong == [], f"rank {rank}: {len(wrong)} of {SOAK_CALLS} calls differ from the oracle: {wrong[:10]}"
