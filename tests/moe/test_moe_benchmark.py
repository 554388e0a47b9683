"""benchmarks/moe.py's host-backend runs (what CI runs of it; the GPU runs need GPUs): the smoke run
(the calls, bf16 and fp8, and the Mixtral-like layer of --shared), the --shared figures on the host
backend (every row, its floors, torch's kernels, its check, the notes and the targets), and the
--shared files from made-up numbers (--dry-run)."""

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
    layers = data["layer"]
    assert len(layers) == 2 and all(layer["check"] is True for layer in layers), layers
    assert all(layer[k] > 0 for layer in layers for k in ("transfer", "overlap", "local")), layers


def test_the_moe_shared_run_on_the_host_backend_checks_every_row_and_judges_the_targets(tmp_path):
    proc = python("benchmarks/moe.py", "--shared", "--host-smoke", "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "moe_hostsmoke_mps.json").read_text())
    assert "no GPU figure" in data["device"]
    world = data["worlds"]["2"]
    assert world["status"] == "ok", world["status"]
    rows = world["rows"]
    steps = [r for r in rows if r["tags"].get("what") == "step"]
    assert {(r["tags"]["step"], r["tags"]["kind"], r["tags"]["mode"]) for r in steps} >= {
        ("dispatch", "bf16", "graph"), ("combine", "fp8", "graph"), ("dispatch", "bf16", "eager")}  # fmt: skip
    for r in steps:  # every step: a value, its floor kernel and torch's, the rule's choice, the copy figure
        assert r["value"] and r["more"]["check"] == "ok on every rank", r
        fl = r["floors"]
        assert fl["kernel_us"] > 0 and fl["torch_us"] > 0 and fl["used"] in ("kernel", "torch"), fl
        assert r["floor"] == (fl["torch_us"] if fl["kernel_us"] > 1.1 * fl["torch_us"] else fl["kernel_us"]), r
        assert r["bytes_moved"] > 0 and r["copy_us"] > 0 and r["copy_ratio"] > 0, r
    combines = [r for r in steps if r["tags"]["step"] == "combine"]
    assert all(len(r["floors"]["torch_candidates_us"]) == 2 for r in combines)
    (layer,) = [r for r in rows if r["tags"].get("what") == "layer"]
    assert layer["more"]["check"] == "ok on every rank" and layer["more"]["wait=False overlap"] > 0, layer
    (fence,) = [r for r in rows if r["tags"].get("what") == "fence"]  # what one token is held against
    assert fence["value"] > 0 and fence["more"]["check"] == "ok on every rank", fence
    notes = world["notes"]
    assert "errors" not in notes, notes.get("errors")
    assert notes["copy_gbps"] > 0 and notes["host_us"]["dispatch_ratio"] > 0, notes
    sweep = notes["programs_sweep"]
    assert len(sweep["rounds"]) == 3 and all(b in (1, 2) for b in sweep["best"]), sweep
    assert all(v["check"] == "ok on every rank" for rd in sweep["rounds"] for v in rd["us"].values()), sweep
    targets = data["targets"]["per_world"]["2"]
    assert len(targets) == 12 and all(t["status"] in ("met", "missed", "reported") for t in targets), targets
    assert all(targets[i]["measured"]["ratio_to_torch"] > 0 for i in range(4)), targets[:4]  # torch's one kernel
    assert "targets (" in data["table"]


def test_the_moe_shared_dry_run_writes_targets_for_every_world(tmp_path):
    proc = python("benchmarks/moe.py", "--shared", "--dry-run", "--worlds", "2,4,8", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "moe_dryrun_mps.json").read_text())
    per = data["targets"]["per_world"]
    assert sorted(per) == ["2", "4", "8"]
    for targets in per.values():
        assert {t["status"] for t in targets} <= {"met", "missed", "reported", "not measured"}
        first = targets[0]
        assert first["target"].startswith("dispatch bf16, 128 tokens") and first["measured"]["ratio_to_torch"]
    assert "floor rule" in data["table"] and data["floor_rule"]
