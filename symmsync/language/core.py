"""The device-side synchronization that every kernel of symmsync shares, written once.

:mod:`symmsync.language` exports what kernels call; this private module holds the pieces
the fences (:mod:`symmsync.language.fence`), the point-to-point signals
(:mod:`symmsync.language.signals`), the failure records (:mod:`symmsync.language.records`) and the
collectives' protocol (:mod:`symmsync.collectives.protocol`) build on, so that each step
of the protocol has one implementation:

* :func:`arrive`: the arrival counter of a multi-program launch (block barrier, a GPU-scope
  acq_rel add; the last program to arrive publishes);
* :func:`bounded_poll`: the bounded wait (a first poll without the clock; the clock and the
  abort flags read only after a poll that failed; status 0, 1 or 2 and the value seen);
* :func:`scan_members`: the one loop over the members' slots of a cell (a lane per member,
  ``LANES`` at a time) that counts the late ones, the aborted ones, or finds the first
  aborted one;
* the primitives whose instructions differ per backend (``_prims``, imported once here).

It imports nothing of the modules above it: the dependency is one-way.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..backends.mode import kernels_interpreted
from . import cells

INTERPRETED: bool = kernels_interpreted()
"""True when this process runs Triton kernels under the interpreter (host backend)."""

DEBUG: bool = os.environ.get("SYMMSYNC_DEBUG", "") == "1"
"""True when ``SYMMSYNC_DEBUG=1`` was set before symmsync was imported: the debug checks
(:func:`~symmsync.language.publish` from one program per launch, peer offsets of
:func:`~symmsync.language.data_ptr` and :func:`~symmsync.language.put_signal` inside the
user region) are compiled into the kernels. Off, they cost nothing: the kernels are the
same instructions as without them."""
_DEBUG = tl.constexpr(DEBUG)

if INTERPRETED:
    from . import prims_interpreted as _prims
else:
    from . import prims_compiled as _prims

#: Lanes per pass when polling the members of a view: one member per lane.
LANES = tl.constexpr(32)

#: Byte offsets inside a cell: this rank's epoch, its arrival counter (grid_fence), its
#: abort reason, and the slots (the epoch line comes first).
EPOCH = tl.constexpr(cells.EPOCH)
ARRIVALS = tl.constexpr(cells.ARRIVALS)
REASON = tl.constexpr(cells.REASON)
SLOTS = tl.constexpr(cells.SLOTS)

#: int64 words of an abort reason, and a power-of-two block that covers them.
_REASON_WORDS = tl.constexpr(cells.REASON_WORDS)
_REASON_LANES = tl.constexpr(triton.next_power_of_2(cells.REASON_WORDS))

#: The abort flag of a slot: its sign bit. A slot that carries it is negative, so a plain
#: ``slot >= e`` never takes an abort for an arrival; the count is ``slot & COUNT_MASK``.
ABORT_FLAG = tl.constexpr(cells.ABORT_FLAG)
#: The bits of a slot that count publishes.
COUNT_MASK = tl.constexpr(cells.COUNT_MASK)
#: The epoch close() stores in this rank's cells: a wait for one at or past it fails at once.
_CLOSED_EPOCH = tl.constexpr(cells.CLOSED_EPOCH)

#: Wait statuses: every member arrived; the budget ran out; a member aborted.
ARRIVED, TIMED_OUT_STATUS, ABORTED_STATUS = 0, 1, 2

#: Comparisons of a signal wait (``CMP``): slot == value, !=, >=, >, <=, <.
EQ = tl.constexpr(0)
NE = tl.constexpr(1)
GE = tl.constexpr(2)
GT = tl.constexpr(3)
LE = tl.constexpr(4)
LT = tl.constexpr(5)
assert [EQ.value, NE.value, GE.value, GT.value, LE.value, LT.value] == [
    cells.CMP_NAMES.index(n) for n in ("EQ", "NE", "GE", "GT", "LE", "LT")
]

#: What :func:`scan_members` computes (``MODE``): the members below the epoch (pending());
#: (those below it without, with an abort flag) (a slow poll of wait()); the members that
#: carry an abort flag, any epoch (a signal wait's slow poll); the first member below the
#: epoch that carries one, storing every slot into a fence record; the first member that
#: carries one, any epoch (a signal record).
BEHIND = tl.constexpr(0)
BEHIND_SPLIT = tl.constexpr(1)
FLAGGED = tl.constexpr(2)
FIRST_BEHIND = tl.constexpr(3)
FIRST_FLAGGED = tl.constexpr(4)

#: What :func:`bounded_poll` waits on (``KIND``): every other member's slot counts the
#: epoch (a fence); one slot compares CMP to a value (a signal); a GPU-scope counter of
#: this launch's programs reaches a target (a grid barrier; no abort flags to read).
MEMBERS = tl.constexpr(0)
VALUE = tl.constexpr(1)
COUNTER = tl.constexpr(2)


@triton.jit
def epoch_ptr(ptrs, cell, me):
    """Pointer to this rank's int64 epoch counter of the cell (in its own memory)."""
    return (tl.load(ptrs + me) + cell + EPOCH).to(tl.pointer_type(tl.int64))


@triton.jit
def slots_ptr(ptrs, cell, index):
    """Pointer to the int64 slots of member ``index``'s cell (``slot[j]``: member j's count)."""
    return (tl.load(ptrs + index) + cell + SLOTS).to(tl.pointer_type(tl.int64))


@triton.jit
def _advance_epoch(ptrs, cell, me):
    ep = epoch_ptr(ptrs, cell, me)
    e = tl.load(ep) + 1
    tl.store(ep, e)
    return e


@triton.jit
def _release_slots(ptrs, cell, me, SIZE: tl.constexpr):
    # The release reductions of a publish: one to each other member's slot for this rank.
    for p in tl.static_range(SIZE):
        dst = (tl.load(ptrs + p) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
        _prims.release_add(dst, p != me)


@triton.jit
def _publish(ptrs, cell, me, SIZE: tl.constexpr):
    # publish() without the debug check: grid_fence, grid_sync and the collectives pick one
    # program per launch themselves (the last to arrive), and which one changes from launch
    # to launch. The reductions go first: a release waits for this thread's earlier
    # writes, and the epoch store is one it need not wait for (a slot counts publishes, so
    # the value sent does not depend on the epoch).
    _release_slots(ptrs, cell, me, SIZE)
    return _advance_epoch(ptrs, cell, me)


@triton.jit
def arrive(counter, ep, last, ptrs, cell, me, SIZE: tl.constexpr, RESET: tl.constexpr):
    """Count this program's arrival at ``counter``; the program that arrives as number ``last`` publishes.

    ``ep`` is this rank's epoch pointer of the cell (:func:`epoch_ptr`), ``ptrs, cell, me, SIZE``
    the publish's arguments.

    Pseudocode::

        block_barrier()                               # this program's writes first
        e = *ep + 1                                   # read before arriving
        n = atomic_add_acq_rel_gpu(counter, 1)
        if n == last:                                 # last one in
            if RESET: counter = 0                     # ready for the next launch
            publish()                                 # the next epoch, released to every member
        return n, e

    Why it is correct: each program's writes, to peers' memory or its own, precede its
    release on the counter; the last program acquires every earlier increment; the block
    barrier that hands the counter's value to its other threads orders that acquire before
    the release reductions of the publish (issued by thread 0), and release is cumulative
    over that chain, so a member that observes the epoch observes every program's writes.
    The arrivals need only GPU scope: the programs that synchronize through the counter
    all run on this GPU, and causality order is transitive across scopes (each link is
    morally strong: GPU scope between this GPU's programs, system scope between the
    publish and a member's acquire). System-scope arrivals cost 0.7–1.0 µs more per launch
    on an H200 with 1024–2048 programs (docs/performance.md, "The PCP writer on one GPU").
    The publisher reads the epoch it advances after acquiring every arrival, so a launch
    that arrives twice (the collectives) advances it twice. Returns ``n`` and ``e``, the
    epoch this program read before arriving, plus one: the epoch the launch's publish
    stores when that publish is the launch's first (grid_fence, grid_sync), since only
    the last program advances it, after every program read it. (A second arrival of one
    launch may read it before the first publish lands: the collectives ignore ``e``.)
    """
    tl.debug_barrier()
    e = tl.load(ep) + 1
    n = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if n == last:
        if RESET:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        _publish(ptrs, cell, me, SIZE)
    return n, e


@triton.jit
def scan_members(slots, me, epoch, record, SIZE: tl.constexpr, MODE: tl.constexpr):
    """One pass over the other members' slots of this rank's cell (acquire loads, a lane per member).

    ``slots`` points at the cell's ``slot[0]``. Returns a pair, by ``MODE``:

    =================  ==================================================================
    ``BEHIND``         (members whose count is below ``epoch``, 0)
    ``BEHIND_SPLIT``   (those of them without an abort flag, those with one)
    ``FLAGGED``        (members that carry an abort flag, 0); ``epoch`` unused
    ``FIRST_BEHIND``   (the first member below ``epoch`` with an abort flag, or SIZE; 0),
                       storing every slot (``epoch`` for this rank's own) at ``record``
    ``FIRST_FLAGGED``  (the first member with an abort flag, or SIZE; 0)
    =================  ==================================================================
    """
    a = 0
    b = 0
    if MODE == FIRST_BEHIND or MODE == FIRST_FLAGGED:
        a = tl.full((), SIZE, tl.int32)  # not from ``me``: a launch may pass it as the constant 1
    for base in tl.static_range(0, SIZE, LANES):
        idx = base + tl.arange(0, LANES)
        live = (idx < SIZE) & (idx != me)
        v = _prims.load_acquire(slots + tl.where(idx < SIZE, idx, me))
        if MODE == BEHIND:
            a += tl.sum((((v & COUNT_MASK) < epoch) & live).to(tl.int32), axis=0)
        elif MODE == BEHIND_SPLIT:
            behind = ((v & COUNT_MASK) < epoch) & live
            a += tl.sum((behind & (v >= 0)).to(tl.int32), axis=0)
            b += tl.sum((behind & (v < 0)).to(tl.int32), axis=0)
        elif MODE == FLAGGED:
            a += tl.sum(((v < 0) & live).to(tl.int32), axis=0)
        elif MODE == FIRST_BEHIND:
            gone = (idx < SIZE) & (idx != me) & ((v & COUNT_MASK) < epoch) & (v < 0)
            a = tl.minimum(a, tl.min(tl.where(gone, idx, SIZE), axis=0))
            tl.store(record + idx, tl.where(idx == me, epoch, v), mask=idx < SIZE)
        else:
            gone = (idx < SIZE) & (idx != me) & (v < 0)
            a = tl.minimum(a, tl.min(tl.where(gone, idx, SIZE), axis=0))
    return a, b


@triton.jit
def compare(v, value, CMP: tl.constexpr):
    """``v CMP value`` as an int32 (1 or 0); CMP is one of EQ, NE, GE, GT, LE, LT."""
    if CMP == EQ:
        r = v == value
    elif CMP == NE:
        r = v != value
    elif CMP == GE:
        r = v >= value
    elif CMP == GT:
        r = v > value
    elif CMP == LE:
        r = v <= value
    else:
        r = v < value
    return r.to(tl.int32)


@triton.jit
def _probe(src, target, table, cell, me, SIZE: tl.constexpr, KIND: tl.constexpr, CMP: tl.constexpr, SLOW: tl.constexpr):
    # One poll of bounded_poll: (what _waiting tests, the value seen, members that aborted).
    # The first poll (not SLOW) reads no abort flag. The slots' address is recomputed from the
    # table each poll, as the polls always did (a cached load: it keeps the kernels' code).
    aborted = 0
    if KIND == MEMBERS:  # x: members still on their way (an abort splits them off when SLOW)
        if SLOW:
            x, aborted = scan_members(slots_ptr(table, cell, me), me, target, src, SIZE, BEHIND_SPLIT)
        else:
            x, _unused = scan_members(slots_ptr(table, cell, me), me, target, src, SIZE, BEHIND)
        seen = x
    elif KIND == VALUE:  # x: the comparison holds (1) or not (0)
        seen = _prims.load_acquire(src)
        x = compare(seen, target, CMP)
        if SLOW:
            aborted, _unused = scan_members(slots_ptr(table, cell, me), me, target, src, SIZE, FLAGGED)
    else:  # x: the counter
        x = tl.atomic_add(src, 0, sem="acquire", scope="gpu")
        seen = x
    return x, seen, aborted


@triton.jit
def _waiting(x, target, KIND: tl.constexpr):
    # True while _probe's ``x`` says the condition does not hold yet.
    if KIND == MEMBERS:
        r = x > 0
    elif KIND == VALUE:
        r = x == 0
    else:
        r = x < target
    return r


@triton.jit
def bounded_poll(
    src, target, table, cell, me, timeout_ns, SIZE: tl.constexpr, KIND: tl.constexpr, CMP: tl.constexpr, refused=0
):
    """Poll until a condition holds, a member aborted or the budget ran out: the one bounded wait.

    Pseudocode::

        done = poll()                                # the fast path: no clock, no abort flag
        if not done:
            start = clock_ns()
            loop:                                    # every load an acquire
                pause(elapsed)                       # host backend only: sleeps once it waited 1 ms
                done, aborted = poll(), scan_aborts()
                if done or aborted or clock_ns() - start > timeout_ns: break
        return (0 if done else 2 if aborted else 1), the value seen by the last poll

    ``KIND`` picks the condition. ``MEMBERS``: every other member's slot in this rank's cell
    (``table[me] + cell``) counts ``target``; a member below it that carries an abort flag
    is an abort; the value seen is how many are still on their way. ``VALUE``:
    ``*src CMP target`` (system-scope acquire loads), with the abort flags of the cell at
    ``table[me] + cell``; the value seen is the slot's. ``COUNTER``: ``*src >= target`` for
    a GPU-scope counter of this launch (GPU-scope acquire loads; no abort flags: status 0
    or 1). The clock is :func:`clock_ns`'s. ``refused`` not 0 fails the first poll whatever
    it saw (status 2, no further poll): a wait through arguments kept past ``close()``.
    Returns ``(status, seen)``.
    """
    x, seen, aborted = _probe(src, target, table, cell, me, SIZE, KIND, CMP, False)
    aborted = (x * 0).to(tl.int32) + tl.where(refused != 0, 1, 0)  # a tensor: the loop carries it
    if _waiting(x, target, KIND) | (refused != 0):  # the clock and the flags only after a first poll that failed
        start = _prims.clock_ns()
        elapsed = start - start
        while _waiting(x, target, KIND) & (aborted == 0) & (elapsed <= timeout_ns):
            _prims.pause(elapsed)  # the host backend sleeps a moment once the wait is long; GPUs spin
            x, seen, aborted = _probe(src, target, table, cell, me, SIZE, KIND, CMP, True)
            elapsed = _prims.clock_ns() - start
    if KIND == MEMBERS:  # an aborted member is not counted as on its way
        status = tl.where(aborted > 0, 2, _waiting(x, target, KIND).to(tl.int32))
    elif KIND == VALUE:  # a value that arrived with an abort counts
        status = tl.where(x != 0, 0, tl.where(aborted > 0, 2, 1))
    else:
        status = _waiting(x, target, KIND).to(tl.int32)
    status = tl.where(refused != 0, 2, status)
    return status.to(tl.int32), seen


@triton.jit
def record_barrier():
    """A fence at system scope in every thread, for records the host reads (GPU: ``fence.sc.sys``).

    Pseudocode::

        fence_sc_sys()                 # every thread; nothing on the host backend

    Contract: this thread's writes before it are performed for every observer, the host
    reading pinned memory included, before its writes after it; and before a
    :func:`trap` that follows it, since the fence waits for them. Write a record's words,
    ``tl.debug_barrier()``, ``record_barrier()``, its flag word, ``record_barrier()``,
    ``tl.debug_barrier()``, then trap: the host that sees the flag sees the words, and the
    flag is not lost to the trap (:func:`symmsync.language.records.finish_record` does so for every
    record of symmsync's). Use plain stores for records in pinned host memory: a GPU
    atomic on host memory needs PCIe atomics, which a machine may lack. Cost: a system
    fence per thread. Graph-safe.
    """
    _prims.memory_barrier_sys()


@triton.jit
def trap():
    """Stop the kernel and the stream (GPU); the host sees a CUDA error. No-op on the host
    backend, where the wait's status reaches the host instead."""
    _prims.trap()


@triton.jit
def program_index():
    """This program's index in its launch's grid, row-major over (x, y, z): what records and reports name."""
    return tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))


@triton.jit
def clock_ns():
    """Nanoseconds from a monotonic clock, as an int64 scalar: the clock of a wait's budget.

    GPU: the global timer (``%globaltimer``), the same on every SM of a device;
    interpreter: ``time.monotonic_ns()``. Use differences, not absolute values. Cost: one
    register read (GPU). Graph-safe.
    """
    return _prims.clock_ns()
