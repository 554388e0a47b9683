"""benchmarks/moe.py's host-backend smoke run (what CI runs of it; the GPU run needs several GPUs):
the calls run, bf16 and fp8, and the JSON names every case."""

import json

from jobs import python


def test_the_moe_benchmark_smoke_run_writes_its_json(tmp_path):
    proc = python("benchmarks/moe.py", "--smoke", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "moe_host_smoke.json").read_text())
    cases = data["us_per_call"][0]
    assert sorted(cases) == ["bf16/1", "bf16/4", "fp8/1", "fp8/4"], cases
    assert all(v["dispatch"] > 0 and v["combine"] > 0 for v in cases.values()), cases
    assert "no GPU figure" in proc.stdout
