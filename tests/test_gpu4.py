"""The CUDA backend on 4 GPUs: exchange, TP×PCP views, fences, graph replay, PCP4 and TP2×PCP2.

Marker ``gpu``; skipped with the reason where fewer than 4 GPUs exist. Run with
``make test-gpu`` on a 4-GPU machine (docs/gpu.md). The same behaviours run with 4
processes on the host backend in the rest of the suite.
"""

import pytest
import test_fence
import test_gpu
import test_pcp
import test_views
import torch

from symmsync.testing import run

WORLD = 4


def _gpus() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _gpus() < WORLD,
        reason=f"needs {WORLD} NVIDIA GPUs, found {_gpus()}: run `make test-gpu` on a 4-GPU machine (docs/gpu.md)",
    ),
]


def test_every_rank_reads_what_every_peer_wrote_on_4_gpus():
    for dst, seen in enumerate(run(test_gpu.cuda_exchange, WORLD, 1 << 20, backend="cuda")):
        assert seen == [[test_gpu.test_buffer._stamp(src, dst)] for src in range(WORLD)], (dst, seen)


def test_tp2_pcp2_views_on_gpus():
    results = run(test_views.tp_pcp_views, WORLD, "cuda", backend="cuda")
    test_views.assert_tp_pcp_views(results)


@pytest.mark.parametrize("mode", ["fence", "split", "overlap"])
def test_fence_payload_oracle_at_world_4(mode):
    for res in run(test_fence.payload_oracle, WORLD, 200, mode, None, "cuda", backend="cuda"):
        assert res["errors"] == 0 and res["epoch"] == 200, res


def test_two_disjoint_2_rank_views_fence_concurrently_on_one_buffer():
    # pcp_view with tp=2: views {0, 2} and {1, 3}, each fencing on its own cells of one buffer.
    for res in run(test_fence.payload_oracle, WORLD, 200, "fence", 2, "cuda", backend="cuda"):
        assert res["errors"] == 0 and res["epoch"] == 200, res


def test_channels_interleave_at_world_4():
    for errors, epochs in run(test_fence.interleaved_channels, WORLD, 100, "cuda", backend="cuda"):
        assert errors == 0 and epochs == [100, 100], (errors, epochs)


def test_a_rank_that_never_arrives_makes_the_other_three_trap_and_raise():
    results = run(
        test_fence.one_rank_never_arrives, WORLD, 2.0, 3, "cuda", backend="cuda", dist_backend="gloo", timeout_s=180
    )
    assert results[3] is None
    for rank in range(3):
        r = results[rank]
        assert isinstance(r, dict), r
        assert r["rank"] == rank and r["late"] == {3: 1} and r["epoch"] == 2, r
        assert r["repeated"]


def test_cuda_graph_replay_at_world_4():
    batches, per_batch = 10, 100
    for log in run(test_gpu.graph_replay, WORLD, batches, per_batch, backend="cuda"):
        assert [d for d, _ in log] == [per_batch] * batches
        assert all(err == 0 for _, err in log), log


@pytest.mark.parametrize("tp", [1, 2], ids=["pcp4", "tp2xpcp2"])
def test_pcp_byte_oracle_eagerly_on_4_gpus(tp):
    test_pcp._assert_oracle(run(test_pcp.byte_oracle, WORLD, tp, 1000, 3, 5, "cuda", backend="cuda"), 3)


@pytest.mark.parametrize("tp", [1, 2], ids=["pcp4", "tp2xpcp2"])
@pytest.mark.parametrize("route,fused", [("direct", False), ("direct", True), ("allgather", False)])
def test_pcp_byte_oracle_in_cuda_graph_replay_on_4_gpus(route, fused, tp):
    replays = 4
    for ok, epoch in run(test_gpu.pcp_graph_replay, WORLD, route, fused, replays, tp, backend="cuda"):
        assert ok == [True] * (2 * replays)
        if route == "direct":
            assert epoch == 2 * (replays + 1)
