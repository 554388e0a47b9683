"""benchmarks/shared.py's rules, and the --shared benchmarks on the host backend (what CI runs of
them; their figures come from ranks sharing one GPU under MPS): the fence's, the collectives' and
the PCP writer's rows each beside their floor kernel and torch's kernels for the same bytes, each
checked on every rank. The floor kernels' own check runs under Triton's interpreter."""

import json
import sys
from pathlib import Path

import pytest
from jobs import python

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from shared import world_deadline  # noqa: E402 - after the path above
from shared_results import FLOOR_RULE, choose_floor  # noqa: E402


@pytest.mark.parametrize(
    ("kernel", "torch", "want"),
    [
        (10.0, 10.0, (10.0, "kernel")),
        (11.0, 10.0, (11.0, "kernel")),  # within the rule
        (11.5, 10.0, (10.0, "torch")),  # slower than 1.1x torch's: torch's figure
        (5.0, 10.0, (5.0, "kernel")),
        ("error: x", 10.0, (10.0, "torch")),  # a failed floor kernel
        (10.0, None, (10.0, "kernel")),  # torch's failed or was not measured
    ],
)
def test_the_floor_rule(kernel, torch, want):
    assert FLOOR_RULE == 1.1
    assert choose_floor(kernel, torch) == want


def test_the_budget_is_shared_among_the_worlds_left():
    first = world_deadline([2, 4, 8], deadline=100.0, now=0.0)
    assert 20 < first < 25  # sqrt(2) of sqrt(2) + 2 + sqrt(8)
    assert world_deadline([8], deadline=100.0, now=40.0) == 100.0
    assert world_deadline([4, 8], deadline=100.0, now=120.0) == 100.0  # past the budget: nothing left
    assert world_deadline([2, 2], deadline=100.0, now=0.0, extra=40.0) == 70.0  # the compiles first, then half


def test_the_floor_kernels_write_what_they_should_under_the_interpreter():
    proc = python("benchmarks/floors.py", TRITON_INTERPRET="1", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all floors write what they should" in proc.stdout


def test_the_shared_benchmarks_run_on_the_host_backend(tmp_path):
    args = ["--bench", "fence", "--bench", "collectives", "--bench", "pcp_kv", "--host-smoke", "--out", str(tmp_path)]
    proc = python("benchmarks/shared.py", *args, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    for bench, count in (("fence", 2), ("collectives", 5), ("pcp_kv", 2)):
        data = json.loads((tmp_path / f"{bench}_hostsmoke_mps.json").read_text())
        world = data["worlds"]["2"]
        assert world["status"] == "ok" and len(world["rows"]) == count, world
        assert bench == "fence" or world["notes"]["copy_gbps"] > 0  # the rows that give their bytes moved
        for r in world["rows"]:
            assert r["value"] and r["floor"] and r["error"] is None, r
            fl = r["floors"]
            assert fl["used"] in ("kernel", "torch") and fl["kernel_us"] > 0 and fl["torch_us"] > 0, r
            assert r["more"].get("check", "ok on every rank") == "ok on every rank", r
        assert "floor rule" in data["table"]
