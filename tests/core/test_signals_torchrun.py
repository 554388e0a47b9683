"""The signals tutorial's example (examples/07_signals.py) as a plain torchrun job of 3 ranks on
the host backend: the pipeline between ranks 0 and 1, the ring exchange over all three, each
line printed once (by rank 0).
"""

from jobs import torchrun


def test_the_signals_example_runs_under_torchrun_at_three_ranks():
    proc = torchrun("examples/07_signals.py", nproc=3, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    pipeline = (
        "pipeline: 8 chunks through a ring of 4 tiles to a slow consumer: every chunk exact; "
        "chunk 0 was done before chunk 7 was sent"
    )
    assert printed.count(pipeline) == 1, proc.stdout
    assert printed.count("ring exchange on 3 ranks: 3 rounds, every block exact") == 1, proc.stdout
