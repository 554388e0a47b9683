"""The examples run as documented (the main demo with its defaults, and a TP×PCP run)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_exchange_example_prints_every_peers_block():
    proc = _run("examples/00_exchange.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 sees the blocks of ranks 0..1 as [100, 101]" in proc.stdout
    assert "rank 1 sees the blocks of ranks 0..1 as [100, 101]" in proc.stdout


@pytest.mark.parametrize(
    "args", [[], ["--tp", "2", "--pcp", "2", "--tokens", "96", "--layers", "2"]], ids=["defaults", "tp2xpcp2"]
)
def test_the_pcp_demo_checks_the_byte_oracle_and_prints_its_table(args):
    proc = _run("examples/pcp_kv.py", "--backend", "host", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "byte oracle" in proc.stdout and ": OK" in proc.stdout
    assert "direct ms/layer" in proc.stdout and "speedup" in proc.stdout


def test_the_demo_explains_its_options():
    proc = _run("examples/pcp_kv.py", "--help")
    assert proc.returncode == 0
    for opt in ("--pcp", "--tp", "--tokens", "--layers", "--backend"):
        assert opt in proc.stdout
