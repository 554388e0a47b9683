"""symmsync.gemm on GPUs (marker ``gpu``; ranks may share GPUs under MPS with
``SYMMSYNC_SHARE_GPUS=1``, at the worlds of ``SYMMSYNC_GPU_WORLDS``): every check of one world in
one job, so that its ranks start and its kernels compile once.

The oracles are tests/gemm_cases.py's (plain torch, integer-valued inputs: equal bit for bit):
both consumers at several row counts (one row, a partial tile, several signal blocks), a weight
given as a transpose, ``out=``; a refused call whose outputs read NaN on every other member before
any synchronization and whose ``synchronize()`` raises PeerRefused naming the refusing member;
members whose rows differ (CallMismatch); a compiled step; a step captured in a CUDA graph and
replayed on new inputs, each replay equal to the oracles.
"""

import helpers
import pytest
import torch
import torch.distributed as dist
from gemm_cases import (
    buffer_bytes,
    compiled,
    exact,
    gathered_reference,
    ints,
    made,
    mismatch,
    refused,
    scattered_reference,
)

import symmsync as ss
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLDS = helpers.gpu_worlds()
SHAPES = [(1, False, False), (100, True, True), (256, False, False)]


def replayed(replays=5, m=64, k=256, n=256, dtype=torch.bfloat16):
    """Both consumers captured once in a CUDA graph, replayed on new inputs: the replays that differ."""
    w, me = dist.get_world_size(), dist.get_rank()
    wrong = []
    with ss.SymmetricBuffer(buffer_bytes(w, 128, k, n, dtype), backend="cuda") as buf:
        ag, rs = made(buf, 128, k, n, dtype)
        with ag, rs:
            x = torch.zeros((m, k), dtype=dtype, device=buf.device)
            y = torch.zeros((w * m, k), dtype=dtype, device=buf.device)
            b = torch.zeros((k, n), dtype=dtype, device=buf.device)
            outs = {}

            def step():
                outs["g"] = ag(x, b)
                outs["s"] = rs(y, b)

            graph = helpers.capture(step)
            for r in range(replays):
                rows = [ints((m, k), 7000 + 10 * r + p, dtype) for p in range(w)]
                big = [ints((w * m, k), 8000 + 10 * r + p, dtype) for p in range(w)]
                bs = [ints((k, n), 9000 + 10 * r + p, dtype) for p in range(w)]
                x.copy_(rows[me])
                y.copy_(big[me])
                b.copy_(bs[me])
                graph.replay()
                g, s = outs["g"].cpu(), outs["s"].cpu()
                want_g, want_s = gathered_reference(rows, bs[me]), scattered_reference(big, bs, me, m)
                if not (torch.equal(g, want_g) and torch.equal(s, want_s)):
                    wrong.append(r)
            ag.synchronize()
            rs.synchronize()
    return wrong


def everything():
    return {
        "exact": exact("cuda", torch.bfloat16, SHAPES, max_rows=256, k=256, n=384),
        "float32": exact("cuda", torch.float32, SHAPES[1:2], max_rows=256, k=64, n=128, calls=1),
        "refused": refused("cuda", dist.get_world_size() - 1),
        "compiled": compiled("cuda"),
        "replayed": replayed(),
        "mismatch": mismatch("cuda"),  # last: it fails the view's consumers
    }


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request):
    helpers.need_gpus("cuda", request.param)
    return request.param


def test_both_consumers_on_gpus(world):
    got = run(everything, world, backend="cuda", timeout_s=600)
    bad = world - 1
    for rank, res in enumerate(got):
        assert res["exact"] == [] and res["float32"] == [], (rank, res["exact"], res["float32"])
        assert res["compiled"] is True and res["replayed"] == [], (rank, res["compiled"], res["replayed"])
        assert res["mismatch"] == ("CallMismatch", "CallMismatch"), (rank, res["mismatch"])
        for name, (raised, nan, ok) in res["refused"].items():
            assert ok == [True, True], (rank, name, ok)
            if rank == bad:
                assert raised.startswith("InputError"), (rank, name, raised)
            else:
                assert raised == f"PeerRefused: rank {bad}: a must be torch.bfloat16, got torch.float64", (rank, raised)
                assert nan is True, f"rank {rank} {name}: the refused call's outputs must read NaN before synchronize()"
