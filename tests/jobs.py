"""Starting a job as a user starts one: ``python script.py`` or a plain torchrun, from a clean environment.

The environment is the test run's, less what would make the job something a user's is not:
``TRITON_INTERPRET`` (``import symmsync`` decides, as in a user's shell) and torchrun's own
variables (the job gets fresh ones).

torchrun starts its processes unbuffered (``python -u``): a ``print`` there writes its text and
its newline apart, so the lines of ranks that print into one pipe interleave ("rank 0:
...rank 3: ...\n\n"). A test of such a job looks for each rank's text, not for whole lines.
(``symmsync.testing.run`` gives the ranks it starts line-buffered streams instead.)
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

from symmsync.testing import TORCHRUN_ENV

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("TRITON_INTERPRET", *TORCHRUN_ENV):
        env.pop(k, None)
    return {**env, **extra}


def python(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """``python *args`` in the repository root."""
    cmd = [sys.executable, *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=job_env(**env), capture_output=True, text=True, timeout=timeout)


def torchrun(script, *args: str, nproc: int = 2, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node nproc script *args`` on a free local port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=job_env(**env), capture_output=True, text=True, timeout=timeout)
