"""The CUDA backend on 4 GPUs: graph replay, PCP4 and TP2×PCP2, eagerly and in graph replay.

Marker ``gpu``; skipped with the reason where fewer than 4 GPUs exist. Run with
``make test-gpu`` on a 4-GPU machine (docs/gpu.md), which also runs the ``cuda`` cases at
world 4 of the host tests that take the ``backend`` fixture (the exchange of
tests/core/test_buffer.py, ...). The same behaviours run with 4 processes on the host backend
in the rest of the suite.
"""

import helpers
import oracles
import pytest

from symmsync.testing import run, sharing_gpus

WORLD = 4
GPUS = helpers.gpu_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        GPUS < WORLD and not sharing_gpus(),
        reason=f"needs {WORLD} NVIDIA GPUs, found {GPUS}: run `make test-gpu` on a 4-GPU machine, or the ranks "
        "sharing one GPU: `make test-gpu-shared` (docs/gpu.md)",
    ),
]


def test_cuda_graph_replay_at_world_4():
    batches, per_batch = 10, 100
    for log in run(helpers.graph_replay, WORLD, batches, per_batch, backend="cuda"):
        assert [d for d, _ in log] == [per_batch] * batches
        assert all(err == 0 for _, err in log), log


@pytest.mark.parametrize("tp", [1, 2], ids=["pcp4", "tp2xpcp2"])
def test_pcp_byte_oracle_eagerly_on_4_gpus(tp):
    oracles.assert_byte_oracle(run(oracles.byte_oracle, WORLD, tp, 1000, 3, 5, "cuda", backend="cuda"), 3)


@pytest.mark.parametrize("tp", [1, 2], ids=["pcp4", "tp2xpcp2"])
@pytest.mark.parametrize("route,fused", [("direct", False), ("direct", True), ("allgather", False)])
def test_pcp_byte_oracle_in_cuda_graph_replay_on_4_gpus(route, fused, tp):
    helpers.need_nccl_in_capture(route, WORLD)
    replays = 4
    for ok, epoch in run(helpers.pcp_graph_replay, WORLD, route, fused, replays, tp, backend="cuda"):
        assert ok == [True] * (2 * replays)
        if route == "direct":
            assert epoch == 2 * (replays + 1)
