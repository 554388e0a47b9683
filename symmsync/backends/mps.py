"""Many ranks on one GPU at the same time: NVIDIA's Multi-Process Service (MPS).

Without MPS, processes that share a GPU time-slice it: no two ranks' kernels ever run at
once, so a multi-rank protocol on one GPU never meets a peer running beside it. With an MPS
control daemon running, the processes become clients of one server and their kernels run
concurrently, each on the share of the SMs that ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` gives
it. symmsync's waits spin on the device, so that share matters: without a cap, W spinning
ranks can hold every SM while a peer's kernel waits for one, and the wait runs out its budget
(seen at W = 8 on one H200). :func:`thread_percentage` is the cap :func:`symmsync.testing.run`
gives each rank: ``100 // ranks per GPU``.

The daemon is found through the same variables the CUDA driver reads:
``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) and ``CUDA_MPS_LOG_DIRECTORY``
(default ``/var/log/nvidia-mps``). :func:`daemon` starts a private one (its own folders) for
a block of code and always stops what it started; ``python -m symmsync mps start|stop|status``
and ``python -m symmsync mps run -- COMMAND`` do the same from a shell (docs/gpu.md, "Many
ranks on one GPU").

What such a run can say, and what not: the peers' memory is the GPU's own HBM, so no figure
measured this way is an NVLink figure; it is the protocol's and the kernels' cost on the same
memory, to be read as a ratio to a floor kernel of the same run. A kernel that traps in one
client is handed by the server to every client of that GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping

from ..errors import ConfigError

CONTROL = "nvidia-cuda-mps-control"
"""The MPS control program (NVIDIA's driver package)."""

PIPE_ENV, LOG_ENV, SHARE_ENV = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
)
DEFAULT_PIPE, DEFAULT_LOG = "/tmp/nvidia-mps", "/var/log/nvidia-mps"
STARTED_MARK = "symmsync-started"
"""A file :func:`start` leaves in the pipe folder: this daemon is one symmsync started."""


@dataclasses.dataclass(frozen=True)
class Daemon:
    """Where an MPS control daemon lives.

    Attributes:
        pipe_dir: its pipe folder (``CUDA_MPS_PIPE_DIRECTORY`` of its clients).
        log_dir: its log folder.
        running: whether it answers.
        started_here: whether symmsync started it (:data:`STARTED_MARK`).
    """

    pipe_dir: str
    log_dir: str
    running: bool
    started_here: bool

    @property
    def env(self) -> dict[str, str]:
        """The variables a client (a rank) needs to find this daemon."""
        return {PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}


def control_program() -> str | None:
    """The path of :data:`CONTROL`, or None where it is not installed (no NVIDIA driver package,
    or not on ``PATH``; NVIDIA's images keep it in ``/usr/local/nvidia/bin``)."""
    found = shutil.which(CONTROL)
    if found is None and os.access(f"/usr/local/nvidia/bin/{CONTROL}", os.X_OK):
        found = f"/usr/local/nvidia/bin/{CONTROL}"
    return found


def _dirs(pipe_dir: str | None, log_dir: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    return pipe_dir or env.get(PIPE_ENV) or DEFAULT_PIPE, log_dir or env.get(LOG_ENV) or DEFAULT_LOG


def _ask(program: str, pipe_dir: str, log_dir: str, command: str, timeout_s: float = 10.0) -> tuple[bool, str]:
    """Send one command to the daemon of ``pipe_dir``: ``(answered, its output)``."""
    env = dict(os.environ, **{PIPE_ENV: pipe_dir, LOG_ENV: log_dir})
    try:
        done = subprocess.run(
            [program], input=command + "\n", env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def status(pipe_dir: str | None = None, log_dir: str | None = None) -> Daemon:
    """The daemon of ``pipe_dir`` (default: ``CUDA_MPS_PIPE_DIRECTORY``, then the driver's default).

    ``running`` is true only when its control pipe exists and it answers ``get_server_list``."""
    pipe_dir, log_dir = _dirs(pipe_dir, log_dir, os.environ)
    program = control_program()
    running = False
    if program is not None and os.path.exists(os.path.join(pipe_dir, "control")):
        running, _ = _ask(program, pipe_dir, log_dir, "get_server_list")
    return Daemon(pipe_dir, log_dir, running, os.path.exists(os.path.join(pipe_dir, STARTED_MARK)))


def running(env: Mapping[str, str] | None = None) -> bool:
    """Whether the daemon that processes with ``env`` (default: this one's) would join answers."""
    pipe, log = _dirs(None, None, os.environ if env is None else env)
    return status(pipe, log).running


def thread_percentage(ranks_per_gpu: int) -> int:
    """The SM share, in percent, for each of ``ranks_per_gpu`` ranks on one GPU: ``100 // n``
    (at least 1). With it no rank's spinning program can hold the SMs a peer's kernel needs."""
    return max(1, 100 // max(1, ranks_per_gpu))


def start(pipe_dir: str | None = None, log_dir: str | None = None, timeout_s: float = 30.0) -> Daemon:
    """Start an MPS control daemon with its own folders and wait until it answers.

    Args:
        pipe_dir: its pipe folder; default: a new one under the temporary folder
            (``symmsync-mps-pipe-*``), so that it shares nothing with a daemon someone else runs.
        log_dir: its log folder; default: a new one (``symmsync-mps-log-*``).
        timeout_s: how long to wait for it to answer.

    Returns:
        the :class:`Daemon`; give its ``env`` to the processes that should be its clients.

    Raises:
        ConfigError: no control program here, a daemon already answers in ``pipe_dir``,
            or the new one did not answer in time (its log folder is named).
    """
    program = control_program()
    if program is None:
        raise ConfigError(
            f"mps start: {CONTROL} was not found (not on PATH, not in /usr/local/nvidia/bin): MPS needs "
            "NVIDIA's driver package; ranks sharing a GPU then time-slice it"
        )
    pipe_dir = pipe_dir or tempfile.mkdtemp(prefix="symmsync-mps-pipe-")
    log_dir = log_dir or tempfile.mkdtemp(prefix="symmsync-mps-log-")
    os.makedirs(pipe_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    if status(pipe_dir, log_dir).running:
        raise ConfigError(
            f"mps start: a daemon already answers in {pipe_dir}; use it ({PIPE_ENV}={pipe_dir}) "
            "or stop it first (python -m symmsync mps stop)"
        )
    env = dict(os.environ, **{PIPE_ENV: pipe_dir, LOG_ENV: log_dir})
    try:
        subprocess.run([program, "-d"], env=env, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"mps start: `{program} -d` failed: {e}; see {log_dir}/control.log") from e
    deadline = time.monotonic() + timeout_s
    while not status(pipe_dir, log_dir).running:
        if time.monotonic() > deadline:
            raise ConfigError(f"mps start: the daemon did not answer within {timeout_s:.0f} s; see {log_dir}")
        time.sleep(0.05)
    with open(os.path.join(pipe_dir, STARTED_MARK), "w") as f:
        f.write(f"{os.getpid()}\n")
    return status(pipe_dir, log_dir)


def stop(pipe_dir: str | None = None, log_dir: str | None = None, timeout_s: float = 30.0) -> bool:
    """Stop the daemon of ``pipe_dir`` (``quit``) and wait until it is gone: True when one was
    running. Its servers end with it, so call this after its clients have exited."""
    pipe_dir, log_dir = _dirs(pipe_dir, log_dir, os.environ)
    program = control_program()
    if program is None or not status(pipe_dir, log_dir).running:
        return False
    _ask(program, pipe_dir, log_dir, "quit", timeout_s)
    deadline = time.monotonic() + timeout_s
    while status(pipe_dir, log_dir).running and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(pipe_dir, STARTED_MARK))
    if status(pipe_dir, log_dir).running:
        raise ConfigError(f"mps stop: the daemon of {pipe_dir} still answers after {timeout_s:.0f} s")
    return True


@contextlib.contextmanager
def daemon(pipe_dir: str | None = None, log_dir: str | None = None) -> Iterator[Daemon]:
    """An MPS daemon for the block: the one already answering in ``pipe_dir`` (default:
    ``CUDA_MPS_PIPE_DIRECTORY``, then the driver's default), left running after the block; or,
    where none answers, a new one that is stopped when the block ends, also after an exception: in
    ``pipe_dir`` (default: ``CUDA_MPS_PIPE_DIRECTORY``), or, where neither names a folder, in
    private new ones.

    Processes given its :attr:`Daemon.env` become its clients; :func:`symmsync.testing.mps` also
    sets it in ``os.environ`` for the block, so that the ranks :func:`symmsync.testing.run` starts
    there are::

        from symmsync.testing import mps, run

        with mps():
            results = run(fn, 8, backend="cuda")  # with SYMMSYNC_SHARE_GPUS=1: 8 ranks on one GPU
    """
    found = status(pipe_dir, log_dir)
    own = not found.running
    d = start(pipe_dir or os.environ.get(PIPE_ENV), log_dir or os.environ.get(LOG_ENV)) if own else found
    try:
        yield d
    finally:
        if own:
            stop(d.pipe_dir, d.log_dir)


def describe() -> str:
    """One line for the doctor: whether MPS is available here and whether a daemon answers."""
    program = control_program()
    if program is None:
        return f"unavailable: {CONTROL} not found; ranks sharing a GPU time-slice it"
    d = status()
    if d.running:
        return f"running ({PIPE_ENV}={d.pipe_dir}): ranks sharing a GPU run at the same time"
    return (
        f"available ({program}), no daemon in {d.pipe_dir}: ranks sharing a GPU time-slice it; "
        "start one with `python -m symmsync mps start` (docs/gpu.md)"
    )


def main(argv: list[str]) -> int:
    """``python -m symmsync mps start|stop|status|run -- COMMAND``.

    ``start`` prints the ``export`` line that makes a shell's later commands its clients; ``run``
    starts a private daemon (or uses the one answering), runs the command and stops what it
    started, also when the command fails; its exit code is the command's."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m symmsync mps", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status", "run"))
    parser.add_argument("--pipe-dir", default=None, help=f"the daemon's pipe folder (default: ${PIPE_ENV})")
    parser.add_argument("--log-dir", default=None, help=f"the daemon's log folder (default: ${LOG_ENV})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="run: the command to run under the daemon")
    args = parser.parse_args(argv)
    try:
        if args.action == "status":
            d = status(args.pipe_dir, args.log_dir)
            print(f"mps: {describe() if args.pipe_dir is None else ('running' if d.running else 'not running')}")
            return 0 if d.running else 1
        if args.action == "stop":
            stopped = stop(args.pipe_dir, args.log_dir)
            print("mps: stopped" if stopped else "mps: no daemon was running")
            return 0
        if args.action == "start":
            d = start(args.pipe_dir or os.environ.get(PIPE_ENV), args.log_dir or os.environ.get(LOG_ENV))
            print(f"export {PIPE_ENV}={d.pipe_dir} {LOG_ENV}={d.log_dir}")
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run needs a command: python -m symmsync mps run -- COMMAND ...")
        with daemon(args.pipe_dir, args.log_dir) as d:
            print(f"mps: daemon in {d.pipe_dir}; running {' '.join(command)}", file=sys.stderr, flush=True)
            return subprocess.call(command, env={**os.environ, **d.env})
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
