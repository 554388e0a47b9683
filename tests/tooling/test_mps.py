"""The MPS tool (``symmsync.backends.mps``, ``python -m symmsync mps``, ``symmsync.testing.mps``)
against a stand-in for NVIDIA's control program.

The stand-in keeps the real one's contract as the tool uses it: ``-d`` starts a daemon whose
``control`` pipe appears in ``CUDA_MPS_PIPE_DIRECTORY``; a command on standard input
(``get_server_list``, ``quit``) reaches the daemon of that folder, and fails with no daemon
there. It also appends every call to a log in its own folder, so a test reads what was asked.
The real program's behaviour under these calls is checked on the GPU machine by the GPU suite's
``make test-gpu-shared`` (docs/gpu.md).
"""

import os
import subprocess
import sys
import warnings

import pytest

from symmsync import testing
from symmsync.backends import mps
from symmsync.errors import ConfigError

FAKE = """#!/bin/sh
d="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
echo "$* $d" >> "$(dirname "$0")/calls.log"
if [ "$1" = "-d" ]; then mkdir -p "$d" && : > "$d/control"; exit 0; fi
read cmd
[ -e "$d/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
echo "$cmd $d" >> "$(dirname "$0")/calls.log"
case "$cmd" in quit) rm -f "$d/control" ;; get_server_list) ;; esac
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """A stand-in control program first on PATH; no daemon named by the environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    prog = bin_dir / mps.CONTROL
    prog.write_text(FAKE)
    prog.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path / "no-daemon-here"))
    monkeypatch.setenv(mps.LOG_ENV, str(tmp_path / "no-log-here"))
    monkeypatch.delenv(mps.SHARE_ENV, raising=False)
    return bin_dir / "calls.log"


def _quits(log):
    return [line for line in log.read_text().splitlines() if line.startswith("quit ")] if log.exists() else []


def test_start_status_stop_use_a_private_folder_and_leave_nothing_running(fake_control):
    assert not mps.status().running
    d = mps.start()
    assert d.running and d.started_here, d
    assert "symmsync-mps" in d.pipe_dir, d.pipe_dir
    assert mps.status(d.pipe_dir).running
    assert not mps.status().running, "the daemon named by the environment was never started"
    with pytest.raises(ConfigError, match="already answers"):
        mps.start(d.pipe_dir, d.log_dir)
    assert mps.stop(d.pipe_dir, d.log_dir) is True
    assert not mps.status(d.pipe_dir).running
    assert mps.stop(d.pipe_dir, d.log_dir) is False, "a second stop finds nothing to stop"


def test_the_context_manager_stops_what_it_started_even_after_a_failure(fake_control):
    before = os.environ[mps.PIPE_ENV]
    with pytest.raises(RuntimeError, match="a failing body"):
        with testing.mps() as d:
            assert os.environ[mps.PIPE_ENV] == d.pipe_dir, "processes started inside are its clients"
            assert mps.running()
            raise RuntimeError("a failing body")
    assert not mps.status(d.pipe_dir).running, "the daemon it started outlived the block"
    assert os.environ[mps.PIPE_ENV] == before, "the environment was not restored"
    assert _quits(fake_control) == [f"quit {d.pipe_dir}"], _quits(fake_control)


def test_the_context_manager_starts_in_the_folder_the_environment_names(fake_control):
    named = os.environ[mps.PIPE_ENV]
    with testing.mps() as d:
        assert d.pipe_dir == named and mps.running()
    assert not mps.status(named).running


def test_the_context_manager_leaves_a_daemon_it_did_not_start_running(fake_control, tmp_path):
    d = mps.start(str(tmp_path / "theirs"), str(tmp_path / "theirs-log"))
    with testing.mps(d.pipe_dir, d.log_dir) as used:
        assert used.pipe_dir == d.pipe_dir
    assert mps.status(d.pipe_dir).running, "a daemon someone else started was stopped"
    assert _quits(fake_control) == []
    mps.stop(d.pipe_dir, d.log_dir)


def test_run_from_the_command_line_stops_the_daemon_and_returns_the_commands_exit_code(fake_control, tmp_path):
    seen = tmp_path / "seen"
    cmd = [
        sys.executable,
        "-m",
        "symmsync",
        "mps",
        "run",
        "--",
        sys.executable,
        "-c",
        f"import os; open({str(seen)!r}, 'w').write(os.environ[{mps.PIPE_ENV!r}]); raise SystemExit(3)",
    ]
    env = {k: v for k, v in os.environ.items() if k not in (mps.PIPE_ENV, mps.LOG_ENV)}  # no folder named
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3, done.stderr
    pipe = seen.read_text()
    assert "symmsync-mps" in pipe, pipe
    assert not mps.status(pipe).running, "mps run left its daemon running after the command failed"
    assert _quits(fake_control) == [f"quit {pipe}"]


def test_status_from_the_command_line_says_whether_a_daemon_answers(fake_control):
    done = subprocess.run(
        [sys.executable, "-m", "symmsync", "mps", "status"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "no daemon" in done.stdout, (done.stdout, done.stderr)
    d = mps.start()
    env = dict(os.environ, **d.env)
    done = subprocess.run(
        [sys.executable, "-m", "symmsync", "mps", "status"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0 and "running" in done.stdout, (done.stdout, done.stderr)
    mps.stop(d.pipe_dir, d.log_dir)


def test_ranks_sharing_a_gpu_under_a_daemon_get_an_equal_sm_share_unless_overridden(fake_control):
    with testing.mps():
        assert testing.sharing_env(8, 1) == {mps.SHARE_ENV: "12"}
        assert testing.sharing_env(4, 1) == {mps.SHARE_ENV: "25"}
        assert testing.sharing_env(2, 1) == {mps.SHARE_ENV: "50"}
        assert testing.sharing_env(8, 2) == {mps.SHARE_ENV: "25"}, "4 ranks on each of 2 GPUs"
        assert testing.sharing_env(3, 2) == {mps.SHARE_ENV: "50"}, "2 ranks on the first GPU"
        assert testing.sharing_env(8, 1, {mps.SHARE_ENV: "30"}) == {}, "run(env=...) overrides the share"
        os.environ[mps.SHARE_ENV] = "40"
        try:
            assert testing.sharing_env(8, 1) == {}, "the caller's environment overrides the share"
        finally:
            del os.environ[mps.SHARE_ENV]


def test_without_a_daemon_sharing_is_time_sliced_and_said_once(fake_control, monkeypatch):
    monkeypatch.setattr(testing.env, "_said_time_sliced", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert testing.sharing_env(2, 1) == {}
        assert testing.sharing_env(4, 1) == {}
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "time-slices" in said[0], said


def test_start_without_the_control_program_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(mps, "control_program", lambda: None)
    with pytest.raises(ConfigError, match="nvidia-cuda-mps-control was not found"):
        mps.start(str(tmp_path / "p"), str(tmp_path / "l"))
    assert "unavailable" in mps.describe()


def test_the_doctor_reports_mps(fake_control):
    from symmsync.tools.doctor import report

    assert "MPS              available" in report()[0]
    with testing.mps():
        assert "MPS              running" in report()[0]
