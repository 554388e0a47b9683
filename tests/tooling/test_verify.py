"""The model-checked protocols (verify/fence.pml, the fence; verify/signals.pml, the point-to-point
signals and their pipelined transfer; verify/collectives.pml, the collectives' slot protocol;
verify/moe.pml, the MoE dispatcher's steps; verify/gemm.pml, symmsync.gemm's tile signals):
every correct configuration verifies exhaustively with 0 errors, and every known-bug variant
yields its counterexample.

Runs the checks of ``make verify`` (verify/check.py) but its heavy configurations
(``check.HEAVY``: millions of states, seconds each), which skip here with that reason:
``make verify``, which CI runs after the tests, checks every configuration, and
SYMMSYNC_VERIFY_ALL=1 runs them here too. Needs Spin and gcc; without them the test fails,
telling how to install Spin, unless SYMMSYNC_SKIP_VERIFY=1 opts out explicitly.
"""

import importlib.util
import os
import pathlib
import re
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
ALL = os.environ.get("SYMMSYNC_VERIFY_ALL") == "1"
HEAVY_SKIP = (
    "a heavy configuration (millions of states): `make verify` checks it (CI runs it after the tests); "
    "SYMMSYNC_VERIFY_ALL=1 checks it here too"
)


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
    # Each step of a check is bounded by check.STEP_TIMEOUT_S (subprocess timeouts). The light
    # configurations' verifiers build without optimization: building takes most of their time, and
    # the exhaustive search, the same at every level, takes a second at most (make verify: -O2).
    configs = [c for c in CONFIGS.values() if ALL or c.name not in check.HEAVY]
    opt = "-O2" if ALL else "-O0"
    return {r.config.name: r for r in check.run_all(configs, jobs=min(2, os.cpu_count() or 1), opt=opt)}


def test_the_heavy_configurations_are_correct_ones_that_check_py_runs():
    assert check.HEAVY <= set(CORRECT), check.HEAVY - set(CORRECT)  # every bug variant runs here
    light = {n for n in CORRECT if n not in check.HEAVY}
    for model in {c.model for c in CONFIGS.values()}:  # every model keeps a correct configuration here
        assert any(CONFIGS[n].model == model for n in light), model


def test_the_bug_variants_are_the_correct_model_plus_one_flag():
    assert BUGGY, "verify/check.py's CONFIGS hold no configuration that expects a counterexample"
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


def test_the_collectives_model_covers_both_sizes_mixed_calls_and_the_bugs_it_must_catch():
    coll = {n: c for n, c in CONFIGS.items() if c.model == "collectives.pml"}
    correct = {n: c for n, c in coll.items() if c.expect == "pass"}
    for n, c in correct.items():
        calls = int(next(f for f in c.flags if f.startswith("C="))[2:])
        assert calls >= 4, n  # each parity reused, and a member one call ahead of another
    mixed = {next(f for f in c.flags if f.startswith("N=")) for c in correct.values() if "KIND=MIX" in c.flags}
    assert mixed == {"N=2", "N=3"}  # every kind of call after every other, at both sizes
    bugs = {}  # (the bug, the kind of call it is planted in) -> the counterexample
    for c in coll.values():
        if c.expect != "pass":
            bug = next(f for f in c.flags if f.startswith("BUG_"))
            bugs[bug, next(f for f in c.flags if f.startswith("KIND="))] = c.expect
    # no parity: a fast member's next copy-in overwrites a slot a slow member still reads
    assert bugs[("BUG_NBUF1", "KIND=ONE")] == "overwrite"
    # no second fence: a two-shot reads a reduced chunk not yet written; a symmetric input is refilled under a reader
    assert bugs[("BUG_NOFENCE2", "KIND=TWO")] == "stale" and bugs[("BUG_NOFENCE2", "KIND=SYM")] == "overwrite"
    # a refused call at both sizes; the kernel blind to it reads an input never copied
    assert {next(f for f in c.flags if f.startswith("N=")) for c in correct.values() if "REFUSE" in c.flags} == {
        "N=2",
        "N=3",
    }
    assert bugs[("BUG_NOREFUSE", "KIND=ONE")] == "stale"
    for n, c in coll.items():
        if c.expect != "pass":  # the correct configuration it plants its bug in is checked too
            assert tuple(f for f in c.flags if not f.startswith("BUG_")) in {k.flags for k in correct.values()}, n


def test_the_moe_model_covers_mismatches_refusals_and_the_bugs_it_must_catch():
    moe = {n: c for n, c in CONFIGS.items() if c.model == "moe.pml"}
    correct = {n: c for n, c in moe.items() if c.expect == "pass"}
    for kind in ("MISMATCH", "REFUSE"):  # at both sizes
        assert {next(f for f in c.flags if f.startswith("N=")) for c in correct.values() if kind in c.flags} == {
            "N=2",
            "N=3",
        }, kind
    bugs = {next(f for f in c.flags if f.startswith("BUG_")): c.expect for c in moe.values() if c.expect != "pass"}
    assert bugs["BUG_NOPARITY"] == "overwrite" and bugs["BUG_NOHEADER"] == "stale" and bugs["BUG_NOREFUSE"] == "stale"
    # a dispatch's rows stored before its counts wait: offsets from counts not landed yet
    assert bugs["BUG_NOCOUNTWAIT"] == "stale"
    for n, c in moe.items():
        if c.expect != "pass":  # the correct configuration it plants its bug in is checked too
            assert tuple(f for f in c.flags if not f.startswith("BUG_")) in {k.flags for k in correct.values()}, n


def test_the_gemm_model_covers_both_sizes_mismatches_refusals_and_the_bugs_it_must_catch():
    gemm = {n: c for n, c in CONFIGS.items() if c.model == "gemm.pml"}
    correct = {n: c for n, c in gemm.items() if c.expect == "pass"}
    sizes = {next(f for f in c.flags if f.startswith("N=")) for c in correct.values()}
    assert sizes == {"N=2", "N=3"} and any("MISMATCH" in c.flags for c in correct.values())
    assert {next(f for f in c.flags if f.startswith("N=")) for c in correct.values() if "REFUSE" in c.flags} == {
        "N=2",
        "N=3",
    }
    bugs = {next(f for f in c.flags if f.startswith("BUG_")): c.expect for c in gemm.values() if c.expect != "pass"}
    assert bugs == {"BUG_NOPARITY": "overwrite", "BUG_NOWAIT": "stale", "BUG_EARLY": "stale", "BUG_NOHEADER": "stale"}
    for n, c in gemm.items():
        if c.expect != "pass":  # the correct configuration it plants its bug in is checked too
            assert tuple(f for f in c.flags if not f.startswith("BUG_")) in {k.flags for k in correct.values()}, n


def test_the_readme_lists_every_configuration_check_py_runs():
    readme = (ROOT / "verify" / "README.md").read_text()
    # the results table's rows: | name | flags, the first a size (VS=, R=, N=) | ...
    rows = re.findall(r"^\| ([a-z0-9-]+) \| [A-Z]+=", readme, flags=re.M)
    assert rows == list(CONFIGS)
    counts = {int(m) for m in re.findall(r"(\d+) configurations", readme)}
    assert counts == {len(CONFIGS)}


@pytest.mark.parametrize("name", CORRECT)
def test_the_protocol_verifies_exhaustively(results, name):
    if name in check.HEAVY and not ALL:
        pytest.skip(HEAVY_SKIP)
    r = results[name]
    assert r.got == "pass" and r.errors == 0, f"{name}: {r.detail}\n{r.output[-3000:]}"
    assert r.states and r.states > 0


@pytest.mark.parametrize("name", BUGGY)
def test_each_known_bug_yields_a_counterexample(results, name):
    r = results[name]
    assert r.errors and r.errors > 0, f"{name}: the model did not catch the bug\n{r.output[-3000:]}"
    assert r.got == CONFIGS[name].expect, f"{name}: expected a {CONFIGS[name].expect} counterexample: {r.detail}"
