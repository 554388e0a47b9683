"""The signals tutorial's example (examples/07_signals.py) as a plain torchrun job of 3 ranks on
the host backend: the pipeline between ranks 0 and 1, the ring exchange over all three, each
line printed once (by rank 0).
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_signals_example_runs_under_torchrun_at_three_ranks():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # as in a user's shell: symmsync decides
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(_free_port()), "examples/07_signals.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    pipeline = (
        "pipeline: 8 chunks through a ring of 4 tiles to a slow consumer: every chunk exact; "
        "chunk 0 was done before chunk 7 was sent"
    )
    assert printed.count(pipeline) == 1, proc.stdout
    assert printed.count("ring exchange on 3 ranks: 3 rounds, every block exact") == 1, proc.stdout
