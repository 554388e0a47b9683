"""No overrun of any length reaches a cell: it faults at a guard, or lands in nothing.

Rank 1 arrives at a fence (the first half of a split fence); a kernel on rank 0 stores
plausible counts (``0x7F7F...``, a huge epoch) past the end of rank 1's user region,
through rank 0's mapping of rank 1's memory (``buf.ptrs[1]``), as a kernel with a wrong
bound would; then rank 1 waits, and rank 0 never fenced: the wait must raise
(``FenceTimeout``, or ``PeerAborted``), never pass. For each kind of memory:

* a short overrun (3 KiB past a 1000-byte user region: the slack of its last page) lands
  in mapped bytes nobody reads; the writer runs on;
* a long one (128 KiB) reaches the guard after the user region, where the writer's
  process dies of ``SIGSEGV`` (memory symmsync maps), or stays inside the runtime's own
  memory (adopted: the runtime's mapping is the runtime's);
* the control: the same counts stored over rank 0's slot in rank 1's cell (through the
  cell table) make the wait pass, so the oracle sees a pass when there is one.

Each kind runs in fresh processes (``testing.run(..., may_die=[0])``): the writer may die.
"""

import gc
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.core import memory
from symmsync.language import cells
from symmsync.testing import Died, run
from symmsync.tools.runtime_alloc import HostCacheAllocator

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm and /proc")

KIB = 1024
NBYTES = 1000  # not a multiple of a page: the bytes just past it are mapped slack
SHORT = 3 * KIB  # stays in the slack of the user region's last page
LONG = 128 * KIB  # far past the page: into the guard (it reached the cells of the old layout)
GARBAGE = 0x7F7F7F7F7F7F7F7F  # a count far past any epoch, no abort flag
BUDGET_S = 1.0  # rank 1's fence: rank 0 never fences, so the right outcome is a timeout
BLOCK = 1024


@triton.jit
def store_words(table, index, offset, n, value, BLOCK: tl.constexpr):
    """``n`` int64 ``value``s from byte ``offset`` of member ``index``'s memory in ``table``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst = ssl.peer_ptr(table, index, offset, tl.int64)
    tl.store(dst + i, value, mask=i < n)


def _store(table, index, offset, nbytes):
    n = nbytes // 8
    store_words[(triton.cdiv(n, BLOCK),)](table, index, offset, n, GARBAGE, BLOCK=BLOCK)


def _buffer(kind):
    """The buffer of ``kind`` with a user region of NBYTES, and what must outlive it."""
    if kind == "allocated":
        return ss.SymmetricBuffer(NBYTES, backend="host"), None
    if kind == "growable":
        return ss.SymmetricBuffer(NBYTES, backend="host", max_nbytes=64 * KIB), None
    if kind == "adopted":  # a runtime's mapping of 256 KiB, of which the first NBYTES are adopted
        owner = ss.SymmetricBuffer(256 * KIB, backend="host")
        return ss.SymmetricBuffer.from_peer_addresses(owner.ptrs.tolist(), NBYTES, device="cpu"), owner
    runtime = HostCacheAllocator(64 * KIB, chunk=64 * KIB)
    runtime.commit(1)
    return ss.SymmetricBuffer.register(runtime.base, NBYTES, device="cpu"), runtime


def _waited(fence):
    """What the second half of rank 1's split fence did: its wait, after the stores."""
    try:
        fence.wait()
    except (ss.FenceTimeout, ss.PeerAborted) as e:
        return type(e).__name__
    return "passed"


def _gone(pid):
    """The process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def overrun(kind, survived):
    """Rank 1 arrives at a fence; rank 0 stores (short past the user region, over the cell,
    long past the user region); then rank 1 waits. Rank 1 returns what each wait did;
    rank 0 returns "survived" or dies in its long stores."""
    buf, keep = _buffer(kind)
    me = buf.rank
    views = {name: buf.view([0, 1]) for name in ("long", "short", "control")}  # the long one in region 0
    fences = {name: ss.Fence(v, timeout_s=BUDGET_S) for name, v in views.items()}
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    out = {}
    for case in ("short", "control", "long"):
        if me == 1:
            fences[case].arrive()  # published; the wait reads this rank's epoch and rank 0's slot
        dist.barrier()
        if me == 1 and case != "long":
            dist.barrier()  # rank 0 stored
            out[case] = _waited(fences[case])
        elif case == "short":
            _store(buf.ptrs, 1, buf.nbytes, SHORT)
            dist.barrier()
        elif case == "control":  # rank 0's count in rank 1's cell, written through the cell table
            _store(views["control"].cell_ptrs, 1, fences["control"].cell + cells.SLOTS, 8)
            dist.barrier()
    if me == 0:
        _store(buf.ptrs, 1, buf.nbytes, LONG)
        Path(survived).write_text("yes")
        return "survived"  # no collective after this: rank 1 does not wait for one
    deadline = time.monotonic() + 60
    while not (os.path.exists(survived) or _gone(pids[0])):
        assert time.monotonic() < deadline, "rank 0 neither finished its stores nor died"
        time.sleep(0.01)
    out["long"] = _waited(fences["long"])
    buf.close()
    return out


@pytest.mark.parametrize("kind", ["allocated", "growable", "adopted", "registered"])
def test_an_overrun_of_any_length_never_makes_a_fence_pass(kind, tmp_path):
    writer, reader = run(overrun, 2, kind, str(tmp_path / "survived"), timeout_s=180, may_die=[0])
    print(f"{kind}: writer {writer}, reader {reader}")
    assert reader["control"] == "passed", reader  # the oracle sees a pass when there is one
    assert reader["short"] in ("FenceTimeout", "PeerAborted"), reader
    assert reader["long"] in ("FenceTimeout", "PeerAborted"), reader  # never "passed"
    if kind == "adopted":  # 128 KiB stay inside the runtime's own 256 KiB mapping
        assert writer == "survived", writer
    else:  # the long stores reached the guard after the user region: the writer died there
        assert writer == Died(0, -signal.SIGSEGV), writer


# ---------------------------------------------------------------------- the guards come and go with the mappings
def _inaccessible(lo, hi):
    """Whether every byte of ``[lo, hi)`` lies in an inaccessible (``---p``) mapping of this process."""
    covered = lo
    with open("/proc/self/maps") as f:
        spans = sorted(tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if line.split()[1] == "---p")
    for start, end in spans:
        if start <= covered < end:
            covered = end
    return covered >= hi


def _anything_at(lo, hi):
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
    return any(start < hi and lo < end for start, end in spans)


def guards_over_a_lifetime():
    """The guards around every mapping of two buffers (each rank's user region and cells, as
    mapped here): inaccessible while the buffers are open, gone once they are closed."""
    bufs = [ss.SymmetricBuffer(NBYTES, backend="host"), ss.SymmetricBuffer(NBYTES, backend="host", max_nbytes=1 << 20)]
    guard = memory.GUARD_BYTES
    fronts = [p - guard for b in bufs for p in b.ptrs.tolist() + b.cell_ptrs.tolist()]
    ends = [p + memory.round_up(b.max_nbytes or b.nbytes, 4096) for b in bufs for p in b.ptrs.tolist()]
    ends += [p + memory.round_up(b.cells.size, 4096) for b in bufs for p in b.cell_ptrs.tolist()]
    opened = all(_inaccessible(p, p + guard) for p in fronts + ends)
    for b in bufs:
        b.close()
    del bufs
    gc.collect()
    left = [p for p in fronts + ends if _anything_at(p, p + guard)]
    return opened, left


def test_every_mapping_lies_between_guards_that_close_unmaps(host_ranks):
    for opened, left in host_ranks(guards_over_a_lifetime, 2):
        assert opened  # a guard before and after each user region and each rank's cells
        assert left == [], [hex(p) for p in left]  # no reservation outlives close()
