"""A tensor or a pointer table taken from a buffer outlives close(): it keeps its memory mapped, never dangles.

Pointer tables (``buf.ptrs``, ``buf.cell_ptrs``, a view's) and ``fence.kernel_args`` kept
past close() hold their mappings (and the fence's record) alive the same way, and a fence
wait launched through kept arguments fails closed.

Reading such a tensor used to unmap-then-read (a segfault), so the read runs in a
subprocess whose exit status is checked. The mapping must still go: with the last
tensor over it, which ``/proc/self/maps`` shows (a shared-memory segment stays listed,
as ``(deleted)``, for as long as this process maps it).
"""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from jobs import python

import symmsync as ss
from symmsync.testing import run

ROOT = Path(__file__).resolve().parents[2]

# Three lines a user writes (a tensor kept past close()), on 2 ranks, with a tensor over the peer's memory too.
KEPT_PAST_CLOSE = """
import pytest
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
    proc = python(script, timeout=300, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "rank 0: own [0.0, 1.0, 2.0, 3.0] peer [10.0, 11.0, 12.0, 13.0]" in lines
    assert "rank 1: own [10.0, 11.0, 12.0, 13.0] peer [0.0, 1.0, 2.0, 3.0]" in lines


def _mapped_segments() -> int:
    """How many of this job's shared-memory segments this process maps now."""
    prefix = "/dev/shm/" + os.environ["SYMMSYNC_SHM_PREFIX"]
    with open("/proc/self/maps") as f:  # a segment may show as several lines
        return len({line.split()[-2 if line.rstrip().endswith("(deleted)") else -1] for line in f if prefix in line})


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
            "open": 4,  # own memory and the peer's, own cells and the peer's
            "closed, tensor held": 1,  # the peers' mappings and the cells went; the held tensor's own memory stays
            "tensor dropped": 0,
            "after 20 cycles": 0,
        }, counts


# Pointer tables and fence arguments kept past close() by a user's code, on 2 ranks: a kernel
# launched through each after both ranks closed (and after the buffer, view and fence objects
# are gone) must run on mapped memory, and the fence wait through the kept arguments must fail
# closed. argv: the kinds of memory (comma-separated: one job runs each in turn), then "plain",
# "no keep-alive" or "no closed epoch" (the last two remove what is under test, to show that the
# test sees it).
KEPT_TABLES = """
import ctypes
import gc
import sys

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.core import memory
from symmsync.language import records
from symmsync.tools.runtime_alloc import HostCacheAllocator
from symmsync.testing import run


@triton.jit
def touch(table, out, SIZE: tl.constexpr, WRITE: tl.constexpr):
    # Every member's first word through the table: read it (an atomic, as a kernel's signal
    # would), and write it where the table names user memory.
    for p in tl.static_range(SIZE):
        word = ssl.peer_ptr(table, p, 0, tl.int64)
        tl.store(out + p, tl.atomic_add(word, 0))
        if WRITE:
            tl.store(word, 100 + p)


@triton.jit
def arrive(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr):
    ssl.publish(ptrs, cell, me, SIZE)


@triton.jit
def wait(ptrs, cell, me, timeout_ns, record, status, SIZE: tl.constexpr):
    e = tl.load(ssl.epoch_ptr(ptrs, cell, me))
    tl.store(status, ssl.wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, False))


def make(kind):
    if kind == "allocated":
        return ss.SymmetricBuffer(4096, backend="host"), None
    if kind == "growable":
        buf = ss.SymmetricBuffer(4096, backend="host", max_nbytes=1 << 20)
        buf.grow(64 << 10)
        return buf, None
    rt = HostCacheAllocator(1 << 20, chunk=64 << 10)
    rt.commit(1)
    return ss.SymmetricBuffer.register(rt.base, 64 << 10, max_nbytes=1 << 20, device="cpu"), rt


def kept(kind, plant):
    if plant == "no keep-alive":
        memory.keep_alive = lambda table, *owners: table
    if plant == "no closed epoch":
        memory.Kind.close_cells = lambda self: None
    buf, runtime = make(kind)
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=0.5)
    fence.fence()
    tables = {
        "buf.ptrs": (buf.ptrs, True),
        "buf.cell_ptrs": (buf.cell_ptrs, buf.cell_ptrs is buf.ptrs),
        "view.ptrs": (view.ptrs, True),
        "view.cell_ptrs": (view.cell_ptrs, view.cell_ptrs is view.ptrs),
    }
    args = fence.kernel_args
    buf.close()
    dist.barrier()  # the peer closed too
    del buf, view, fence
    gc.collect()
    out = {}
    for name, (table, write) in tables.items():
        seen = torch.full((2,), -1, dtype=torch.int64)
        touch[(1,)](table, seen, SIZE=2, WRITE=write)
        out[name] = seen.tolist()
    dist.barrier()
    arrive[(1,)](*args, SIZE=2)  # every rank publishes through its kept arguments ...
    dist.barrier()
    status = torch.full((1,), -1, dtype=torch.int32)
    wait[(1,)](*args, status, SIZE=2)  # ... before either waits
    flag = ctypes.c_int64.from_address(args[4]).value  # the record, kept by the arguments
    out["wait"] = int(status.item()), {records.TIMED_OUT: "timed out", records.ABORTED: "aborted"}.get(flag, flag)
    return out


def kept_each(kinds, plant):
    return {kind: kept(kind, plant) for kind in kinds}


if __name__ == "__main__":
    for rank, out in enumerate(run(kept_each, 2, sys.argv[1].split(","), sys.argv[2])):
        print(f"rank {rank}: {out}")
"""


KINDS = ["allocated", "growable", "registered"]


def _run_kept(tmp_path, kinds, plant):
    script = tmp_path / "kept_tables.py"
    script.write_text(KEPT_TABLES)
    return python(script, ",".join(kinds), plant, timeout=300, TRITON_INTERPRET="1")


def _results(proc, kind):
    lines = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("rank ")]
    return [eval(line)[kind] for line in lines]  # noqa: S307


@pytest.fixture(scope="module")
def kept_plain(tmp_path_factory):
    """One job for every kind, in turn (starting processes is most of a job's time)."""
    return _run_kept(tmp_path_factory.mktemp("kept"), KINDS, "plain")


@pytest.mark.parametrize("kind", KINDS)
def test_tables_and_fence_arguments_kept_past_close_launch_on_mapped_memory_and_the_wait_fails_closed(kept_plain, kind):
    proc = kept_plain
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = _results(proc, kind)
    assert len(results) == 2, proc.stdout
    for out in results:
        for name in ("buf.ptrs", "buf.cell_ptrs", "view.ptrs", "view.cell_ptrs"):
            assert len(out[name]) == 2 and -1 not in out[name], (name, out)
        # The first user words were written through the first table, then read through the
        # others: each rank's memory (own and peer's) reads what a kernel stored there.
        assert out["view.ptrs"] == [100, 101], out
        status, why = out["wait"]
        assert status in (1, 2) and why in ("timed out", "aborted"), out  # never 0: never passes


def test_without_the_keep_alive_a_launch_through_kept_tables_crashes_the_rank(tmp_path):
    # What the test above would see if the tables did not hold their mappings.
    proc = _run_kept(tmp_path, ["allocated"], "no keep-alive")
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "exited with code -11" in proc.stderr or "SIGSEGV" in proc.stderr, proc.stderr[-3000:]


def test_without_the_closed_epoch_the_kept_wait_would_pass(tmp_path):
    # What the first test would see if close() left the epochs as they were.
    proc = _run_kept(tmp_path, ["allocated"], "no closed epoch")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [out["wait"][0] for out in _results(proc, "allocated")] == [0, 0]
