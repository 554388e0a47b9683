"""``python -m symmsync doctor`` says a backend works only after it allocated a buffer there
and fenced on it, and says what failed when that did not work.

The oracles: the report's backend lines and exit status, and spies on the allocation, the
fence and the close (they ran, in that order, in the doctor's process). On this test's
process the kernels run under the interpreter (conftest.py), so the host backend is tried
in-process, where a monkeypatch reaches it; the command-line test starts the doctor with
the kernels compiled (``TRITON_INTERPRET=0``), so that it tries the host backend in a
child process that interprets them.
"""

from pathlib import Path

import pytest
import torch.distributed as dist
from jobs import python

from symmsync import BackendError, FenceTimeout
from symmsync.backends import mode
from symmsync.core.buffer import SymmetricBuffer
from symmsync.core.fence import Fence
from symmsync.tools import doctor

ROOT = Path(__file__).resolve().parents[2]
HOST_WORKS = "  host  works: POSIX shared memory + Triton interpreter (TRITON_INTERPRET=1); a 4096-byte buffer"

pytestmark = pytest.mark.skipif(
    not mode.kernels_interpreted(), reason="the doctor is tried in-process where this process interprets kernels"
)


def _host_line(text):
    return next(line for line in text.splitlines() if line.startswith("  host "))


@pytest.fixture
def spies(monkeypatch):
    """What the doctor ran, in order: "allocate", "fence", "close"."""
    calls = []
    for cls, name in ((SymmetricBuffer, "__init__"), (Fence, "fence"), (SymmetricBuffer, "close")):
        real = getattr(cls, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls.append({"__init__": "allocate"}.get(_name, _name))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    return calls


def test_the_host_backend_works_once_a_buffer_was_allocated_and_fenced_on(spies):
    text, ok = doctor.report()
    assert _host_line(text) == HOST_WORKS + " allocated and fenced on", text
    assert ok and spies == ["allocate", "fence", "close"], spies
    assert not dist.is_initialized()  # the doctor's one-rank group is gone again


def test_a_failed_allocation_makes_the_host_backend_unavailable_saying_so(monkeypatch, spies):
    def no_memory(self, *args, **kwargs):
        spies.append("allocate")
        raise BackendError("planted: /dev/shm refused the segment")

    monkeypatch.setattr(SymmetricBuffer, "__init__", no_memory)
    text, ok = doctor.report()
    line = _host_line(text)
    assert line.startswith("  host  unavailable: POSIX shared memory"), line
    assert line.endswith(
        f"but allocating a {doctor.PROBE_BYTES}-byte buffer failed: BackendError: planted: /dev/shm refused the segment"
    ), line
    assert spies == ["allocate"] and not dist.is_initialized()
    if "  cuda  unavailable" in text:  # no other backend: the doctor fails
        assert not ok


def test_a_failed_fence_makes_the_host_backend_unavailable_and_still_closes_the_buffer(monkeypatch, spies):
    def times_out(self):
        spies.append("fence")
        raise FenceTimeout("planted: the fence timed out", rank=0, epoch=1, late={}, channel=0)

    monkeypatch.setattr(Fence, "fence", times_out)
    ok, why = doctor.allocate_and_fence("host")
    assert not ok and why == "fencing on it failed: FenceTimeout: planted: the fence timed out", why
    assert spies == ["allocate", "fence", "close"] and not dist.is_initialized()


def test_the_command_exits_0_where_a_backend_works_trying_the_host_in_an_interpreting_process():
    proc = python("-m", "symmsync", "doctor", timeout=300, TRITON_INTERPRET="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TRITON_INTERPRET 0" in proc.stdout and _host_line(proc.stdout).startswith(HOST_WORKS), proc.stdout


def test_on_a_gpu_the_mps_line_says_startable_only_after_a_daemon_started_and_stopped(monkeypatch):
    from symmsync.backends import mps

    monkeypatch.setattr(mps, "control_program", lambda: "/usr/bin/nvidia-cuda-mps-control")
    monkeypatch.setattr(mps, "running", lambda env=None: False)
    tried = []
    line = doctor.mps_line(1, probe=lambda: tried.append("start and stop"))
    assert tried == ["start and stop"]
    assert line.startswith("startable (a daemon started and stopped in private folders): 1 GPU(s)"), line
    assert "SYMMSYNC_SHARE_GPUS=1 python -m symmsync mps run -- python JOB.py" in line

    def fails():
        raise RuntimeError("a daemon did not start: mps start: the daemon did not answer within 30 s")

    line = doctor.mps_line(1, probe=fails)
    assert "but a daemon did not start: mps start: the daemon did not answer within 30 s" in line, line
    assert "time-slice" in line and not line.startswith("startable")
    # No GPU, or no control program: nothing is started, and the line says what is missing.
    assert doctor.mps_line(0, probe=fails).startswith("available (/usr/bin/nvidia-cuda-mps-control), no daemon")
    monkeypatch.setattr(mps, "control_program", lambda: None)
    assert doctor.mps_line(1, probe=fails).startswith("unavailable: nvidia-cuda-mps-control not found")


def test_the_doctor_s_mps_probe_says_which_step_failed_and_leaves_no_folder(monkeypatch, tmp_path):
    import tempfile

    from symmsync import ConfigError
    from symmsync.backends import mps

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = []
    monkeypatch.setattr(mps, "start", lambda pipe, log: calls.append(("start", pipe, log)))

    def stuck(pipe, log):
        raise ConfigError("mps stop: the daemon still answers after 30 s")

    monkeypatch.setattr(mps, "stop", stuck)
    with pytest.raises(ConfigError, match="the daemon started but did not stop: mps stop: the daemon still"):
        doctor._start_and_stop()
    assert calls and calls[0][1].startswith(str(tmp_path)) and list(tmp_path.iterdir()) == []
