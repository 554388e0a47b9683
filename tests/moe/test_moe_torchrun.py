"""The MoE tutorial's example (examples/10_moe.py) as a plain torchrun job of 2 ranks on the host
backend: torchrun's processes are the ranks, and each checks its layers against plain torch."""

from jobs import torchrun


def test_the_moe_example_runs_under_torchrun():
    proc = torchrun("examples/10_moe.py", nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("2 ranks: 3 MoE layers, top-2 of 4 experts: bit for bit") == 1, proc.stdout
    for r in (0, 1):
        assert sum(f"rank {r}: layer {i}:" in proc.stdout for i in range(3)) == 3, proc.stdout
