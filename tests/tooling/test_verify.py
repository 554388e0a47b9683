"""The model-checked protocols (verify/fence.pml, the fence; verify/signals.pml, the point-to-point
signals and their pipelined transfer): every correct configuration verifies exhaustively with
0 errors, and every known-bug variant yields its counterexample.

Runs the same checks as ``make verify`` (verify/check.py). Needs Spin and gcc; without them the
test fails, telling how to install Spin, unless SYMMSYNC_SKIP_VERIFY=1 opts out explicitly.
"""

import importlib.util
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("symmsync_verify_check", ROOT / "verify" / "check.py")
check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = check  # dataclasses look their module up there
_spec.loader.exec_module(check)

CONFIGS = {c.name: c for c in check.CONFIGS}
CORRECT = [n for n, c in CONFIGS.items() if c.expect == "pass"]
BUGGY = [n for n, c in CONFIGS.items() if c.expect != "pass"]


@pytest.fixture(scope="module")
def results():
    if os.environ.get("SYMMSYNC_SKIP_VERIFY") == "1":
        pytest.skip("SYMMSYNC_SKIP_VERIFY=1: model checking opted out")
    missing = check.missing_tools()
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not found: run `make verify` (it installs spin with apt-get) or "
            "`apt-get install spin gcc`; set SYMMSYNC_SKIP_VERIFY=1 to opt out explicitly",
            pytrace=False,
        )
    # Each step of a check is bounded by check.STEP_TIMEOUT_S (subprocess timeouts).
    return {r.config.name: r for r in check.run_all(list(CONFIGS.values()), jobs=min(2, os.cpu_count() or 1))}


def test_the_bug_variants_are_the_correct_model_plus_one_flag():
    for name in BUGGY:
        bugs = [f for f in CONFIGS[name].flags if f.startswith("BUG_")]
        assert len(bugs) == 1, name


def test_both_sizes_and_several_fences_are_covered():
    fence = [n for n in CORRECT if CONFIGS[n].model == "fence.pml"]
    sizes = {f for n in fence for f in CONFIGS[n].flags if f.startswith("VS=")}
    assert sizes == {"VS=2", "VS=3"}
    for n in fence:
        fences = int(next(f for f in CONFIGS[n].flags if f.startswith("F="))[2:])
        assert fences >= 3, n  # wrap-around of the double buffer and a rank one fence ahead


def test_the_signal_model_covers_replays_aborts_and_the_bugs_it_must_catch():
    signal = {n: CONFIGS[n] for n in CONFIGS if CONFIGS[n].model == "signals.pml"}
    for n, c in signal.items():
        if c.expect == "pass":
            launches = int(next(f for f in c.flags if f.startswith("K="))[2:])
            assert launches >= 2, n  # a relative base is only tested across replays
    bugs = {next(f for f in c.flags if f.startswith("BUG_")): c.expect for c in signal.values() if c.expect != "pass"}
    # a missing release, and == where replays need >=, each yield their counterexample
    assert bugs["BUG_RELAXED"] == "payload" and bugs["BUG_EQ"] == "deadlock" and bugs["BUG_ABS"] == "payload"
    assert any("ABORT" in c.flags and c.expect == "pass" for c in signal.values())


@pytest.mark.parametrize("name", CORRECT)
def test_the_protocol_verifies_exhaustively(results, name):
    r = results[name]
    assert r.got == "pass" and r.errors == 0, f"{name}: {r.detail}\n{r.output[-3000:]}"
    assert r.states and r.states > 0


@pytest.mark.parametrize("name", BUGGY)
def test_each_known_bug_yields_a_counterexample(results, name):
    r = results[name]
    assert r.errors and r.errors > 0, f"{name}: the model did not catch the bug\n{r.output[-3000:]}"
    assert r.got == CONFIGS[name].expect, f"{name}: expected a {CONFIGS[name].expect} counterexample: {r.detail}"
