"""A tensor taken from a buffer outlives close(): it keeps its memory mapped, never dangles.

Reading such a tensor used to unmap-then-read (a segfault), so the read runs in a
subprocess whose exit status is checked. The mapping must still go: with the last
tensor over it, which ``/proc/self/maps`` shows (a shared-memory segment stays listed,
as ``(deleted)``, for as long as this process maps it).
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync.testing import run

ROOT = Path(__file__).resolve().parents[2]

# Three lines a user writes (a tensor kept past close()), on 2 ranks, with a tensor over the peer's memory too.
KEPT_PAST_CLOSE = """
import torch
import symmsync as ss
from symmsync.testing import run

def kept(_):
    buf = ss.SymmetricBuffer(1024, backend="host")
    me, peer = buf.rank, 1 - buf.rank
    buf.tensor(0, (4,), torch.float32).copy_(torch.arange(4) + 10 * me)
    ss.Fence(buf.view([0, 1])).fence()  # the peer's values are in its memory
    t = buf.tensor(0, (4,), torch.float32)
    p = buf.tensor(0, (4,), torch.float32, rank=peer)
    buf.close()
    print(t, p)  # as in the report
    return t.tolist(), p.tolist()

if __name__ == "__main__":
    for rank, (own, theirs) in enumerate(run(kept, 2, None)):
        print(f"rank {rank}: own {own} peer {theirs}")
"""


def test_tensors_kept_past_close_read_their_values_and_the_process_exits_cleanly(tmp_path):
    script = tmp_path / "kept.py"  # a file: the ranks import its functions
    script.write_text(KEPT_PAST_CLOSE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "rank 0: own [0.0, 1.0, 2.0, 3.0] peer [10.0, 11.0, 12.0, 13.0]" in lines
    assert "rank 1: own [10.0, 11.0, 12.0, 13.0] peer [0.0, 1.0, 2.0, 3.0]" in lines


def _mapped_segments() -> int:
    """How many of this job's shared-memory segments this process maps now."""
    prefix = "/dev/shm/" + os.environ["SYMMSYNC_SHM_PREFIX"]
    with open("/proc/self/maps") as f:
        return sum(prefix in line for line in f)


def mapping_lifetime():
    gc.collect()
    counts = {"start": _mapped_segments()}
    buf = ss.SymmetricBuffer(1 << 16, backend="host")
    counts["open"] = _mapped_segments()
    t = buf.tensor(16, (4,), torch.int32)[1:]  # a view of a slice: still the same mapping
    buf.close()
    gc.collect()
    counts["closed, tensor held"] = _mapped_segments()
    t.fill_(dist.get_rank())
    del t
    gc.collect()
    counts["tensor dropped"] = _mapped_segments()
    for _ in range(20):
        with ss.SymmetricBuffer(1 << 16, backend="host") as b:
            b.tensor(0, (8,), torch.int64, rank=1 - b.rank).fill_(1)
    gc.collect()
    counts["after 20 cycles"] = _mapped_segments()
    return counts


def test_the_mapping_goes_with_the_last_tensor_and_cycles_leave_nothing_mapped():
    for counts in run(mapping_lifetime, 2):
        assert counts == {
            "start": 0,
            "open": 2,  # own memory and the peer's
            "closed, tensor held": 1,  # the peer mapping went; the held tensor's own mapping stays
            "tensor dropped": 0,
            "after 20 cycles": 0,
        }, counts
