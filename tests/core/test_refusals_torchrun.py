"""A refused call in a plain torchrun job of 2 ranks on the host backend (tests/refusals_job.py): an
all-reduce, a MoE dispatch and a PCP write on both routes, each made badly on the last rank, fail on every rank
(the last rank its own error, the other ``PeerRefused`` naming it), and the next calls are right."""

from jobs import torchrun


def test_a_refused_call_fails_once_on_every_rank_of_a_torchrun_job():
    proc = torchrun("tests/refusals_job.py", nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    want = {
        "rank 0: all-reduce: PeerRefused(origin=1); the next sums: True",
        "rank 1: all-reduce: InputError; the next sums: True",
        "rank 0: dispatch: PeerRefused(origin=1); the next layer right: True",
        "rank 1: dispatch: InputError; the next layer right: True",
        "rank 0: write: PeerRefused(origin=1); the next layer in every replica alike: True",
        "rank 1: write: InputError; the next layer in every replica alike: True",
        "rank 0: write (allgather): PeerRefused(origin=1); the next layer in every replica alike: True",
        "rank 1: write (allgather): InputError; the next layer in every replica alike: True",
    }
    missing = [line for line in sorted(want) if out.count(line) != 1]
    assert not missing, (missing, out[-3000:])
