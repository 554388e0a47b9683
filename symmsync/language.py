"""Device-side primitives for Triton kernels: peer addresses, publish, wait, fence.

Call these from your own ``@triton.jit`` kernels. They take a peer view's pointer
table (``view.ptrs``, int64 base addresses in view order), the byte offset of a
signal cell (``view.signal_offset(channel)``), this rank's index in the view
(``view.local_index``) and the view size as a compile-time constant (``SIZE``)::

    @triton.jit
    def exchange(ptrs, cell, me, value, timeout_ns, SIZE: tl.constexpr):
        for p in tl.static_range(SIZE):
            dst = ssl.peer_ptr(ptrs, p, 0, tl.int64)
            tl.store(dst + me, value)            # payload into every peer
        tl.debug_barrier()                        # every thread's payload before the release
        e = ssl.publish(ptrs, cell, me, SIZE)
        status = ssl.wait(ptrs, cell, me, e, timeout_ns, SIZE)

A :class:`~symmsync.Fence` hands a kernel its arguments at once:
``fence.kernel_args`` is ``(ptrs, cell, me, timeout_ns, record)``.

The signal primitives (publish, wait, and everything built on them) take the table the
cells are offset from, ``view.signal_ptrs``. For memory symmsync allocated that is the
same tensor as ``view.ptrs``, so one table serves the payload and the signals, as above;
a runtime's registered memory keeps its cells apart, and then a kernel takes both
tables (``fence.kernel_args`` carries the signal table).

Memory model (the contract, on both backends; the one statement of it)::

    --8<-- [start:contract]   (docs/concepts.md and docs/fences.md show this block as written here)
    e = publish()  advances this rank's epoch to e and releases it to every other member:
                   every write this rank made before it (from the same kernel after a block
                   barrier, and from kernels earlier on the stream) happens-before any read
                   by a member that observed its slot >= e.        [release, system scope]
    wait(e)        returns 0 only once every other member's slot for this rank counts >= e;
                   reads after it see everything those members wrote before their
                   publish(e).                                     [acquire, system scope]
                   Bounded by a budget: 1 when it ran out, 2 at once when a member aborted
                   before publishing e. A wait that times out or sees an abort fails
                   closed: nothing after it may read peer data.
    fence()        publish(); wait(e): on return every member reached the fence
                   (Fence.fence() on the host, publish_and_wait() inside a kernel).
    epochs         int64, only grow; compared with >=, never ==, so a member one fence
                   ahead is harmless and nothing is ever reset. A slot counts its member's
                   publishes (bits 0..62), so it always equals that member's epoch.
    abort          mark_abort() writes a reason into this rank's own cell line, then sets
                   the sign bit (ABORT_FLAG) of its slot at every other member [release,
                   system scope]. wait(e) compares the count (slot & COUNT_MASK) with e: a
                   member whose count reached e arrived (its data is valid, flag or not);
                   one whose count is below e and whose flag is set aborted (status 2).
    members        every member calls the same sequence of fences on a channel; a fence
                   orders the members of its view on its channel only.
    reuse          a fence orders visibility; it does not stop a fast member from
                   overwriting memory a slow one still reads: double-buffer reused payload
                   (by epoch parity) or fence twice.
    --8<-- [end:contract]

Point-to-point signals (a :class:`~symmsync.Signals` object gives their arguments,
``sigs.kernel_args`` = ``(sig, me, timeout_ns, record)`` and ``sigs.constexprs`` =
``SIZE``, ``NSLOTS``, ``TRAP``) have the same memory model, one peer at a time::

    --8<-- [start:signals-contract]   (docs/signals.md shows this block as written here)
    signal(v)      ADD v to, or SET v in, the slot this rank has at a peer: every write this
                   rank made before it (by this thread; by the block's other threads once
                   they passed tl.debug_barrier(); by kernels earlier on the stream) is
                   visible to the peer once it observes the value this signal produced.
                                                                   [release, system scope]
    wait_signal    returns 0 only once the slot compares CMP (EQ NE GE GT LE LT) to value;
                   reads after it see every write the peer made before the signal that
                   produced the value observed.                    [acquire, system scope]
    wait_count(n)  as wait_signal(GE, base + n), then base += n. base is device memory that
                   only this rank's counted waits advance: replay safe, never reset.
    put_signal     the tile's stores by every thread, a block barrier, thread 0's release
                   add of 1: the peer sees the whole tile once it sees the count. Call it
                   from a whole program (every thread reaches the barrier).
    read_signal    one acquire load of a slot.
    budget         the same clock and budget as a fence's wait (clock_ns: %globaltimer on
                   GPUs, time.monotonic_ns() under the interpreter): 1 when it ran out, 2 at
                   once when a member aborted. A wait that times out or sees an abort fails
                   closed: nothing after it may read peer data. It writes a record (this
                   rank, the peer, the slot, the value and comparison awaited, the value
                   observed) and traps with TRAP.
    abort          a member's abort (its close(), an error, view.abort()) ends every signal
                   wait on the view within a poll (status 2): the waits read the abort flags
                   that the view's abort sets in its cells. A signal that arrived before the
                   abort still counts.
    reuse          a signal orders visibility only: a ring of reused tiles needs credits.
    --8<-- [end:signals-contract]

:func:`data_ptr` is :func:`peer_ptr` through the handle (debug mode checks the user region).
Peer atomics are Triton's own on a :func:`peer_ptr` (``tl.atomic_add(ptr, v, sem=...,
scope="sys")``): pass ``scope="sys"`` for a peer's memory (docs/signals.md lists each and
its order).

:func:`grid_sync` is a fence in which every program of a co-resident grid waits
(:func:`symmsync.launch_grid_sync` checks the grid). With ``SYMMSYNC_DEBUG=1`` (:data:`DEBUG`)
the kernels check that one program per launch publishes on a channel and that the offsets
of :func:`data_ptr` and :func:`put_signal` lie inside the user region.

A cell is the same byte offset ``cell`` in every member's memory; its layout (epoch,
arrivals, abort reason, slots) and the timeout record's are :mod:`symmsync.cells`'s, the
one source of both, exported here as constants (:data:`EPOCH`, :data:`ARRIVALS`,
:data:`REASON`, :data:`SLOTS`, ...).

Backends. The same source runs compiled on NVIDIA GPUs and under Triton's
interpreter on the host backend. The few primitives whose instructions differ live
in one module per backend (``symmsync._prims_compiled``, ``symmsync._prims_interpreted``,
the same names in both); this module imports one of them once, when it is imported
(``INTERPRETED``, from :func:`symmsync.mode.kernels_interpreted`), never at run time:

================  ======================  ==================================  ===============================
operation         primitive               GPU (compiled)                      host (interpreter)
================  ======================  ==================================  ===============================
publish           ``release_add``         ``red.release.sys.global.add``      ``atomic_add`` release (a real
                                          (no reply round trip)               lock-free atomic across processes)
abort flag        ``release_or``          ``red.release.sys.global.or``       ``atomic_or`` release
wait load         ``load_acquire``        ``ld.acquire.sys.global.b64``       ``atomic_add(0)`` acquire
signal ADD        ``signal_add``          ``red.release.sys.global.add.u64``  ``atomic_add`` release
signal SET        ``signal_set``          ``st.release.sys.global.b64``       ``atomic_xchg`` release
clock             ``clock_ns``            ``%globaltimer`` (ns)               ``time.monotonic_ns()``
record barrier    ``memory_barrier_sys``  ``fence.sc.sys``                    none
trap              ``trap``                ``trap`` (stream stops)             none: the host reads the status
debug stamp       ``launch_id``           ``%gridid``                         a count of interpreter launches
debug report      ``debug_fail``          ``printf`` and ``trap``             raises DebugCheckError
co-residency      ``check_co_resident``   none (checked before the launch)    refuses a grid of > 1 program
================  ======================  ==================================  ===============================

:func:`clock_ns` and :func:`trap` are public here too.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from . import cells
from .mode import kernels_interpreted

INTERPRETED: bool = kernels_interpreted()
"""True when this process runs Triton kernels under the interpreter (host backend)."""

DEBUG: bool = os.environ.get("SYMMSYNC_DEBUG", "") == "1"
"""True when ``SYMMSYNC_DEBUG=1`` was set before symmsync was imported: the debug checks
(:func:`publish` from one program per launch, peer offsets of :func:`data_ptr` and
:func:`put_signal` inside the user region) are compiled into the kernels. Off, they cost
nothing: the kernels are the same instructions as without them."""
_DEBUG = tl.constexpr(DEBUG)

if INTERPRETED:
    from . import _prims_interpreted as _prims
else:
    from . import _prims_compiled as _prims

#: Lanes per pass when polling the members of a view: one member per lane.
LANES = tl.constexpr(32)

#: Byte offsets inside a cell: this rank's epoch, its arrival counter (grid_fence), its
#: abort reason, and the slots (the epoch line comes first).
EPOCH = tl.constexpr(cells.EPOCH)
ARRIVALS = tl.constexpr(cells.ARRIVALS)
REASON = tl.constexpr(cells.REASON)
SLOTS = tl.constexpr(cells.SLOTS)

#: int64 words of an abort reason: code, text length in bytes, then the UTF-8 text.
REASON_WORDS: int = cells.REASON_WORDS
#: Bytes of reason text a cell holds (the words after the code and the length).
REASON_TEXT_BYTES: int = cells.REASON_TEXT_BYTES
#: Reason codes (word 0 of a reason): the member closed its buffer; it failed (any other cause).
REASON_CLOSED: int = cells.REASON_CLOSED
REASON_ERROR: int = cells.REASON_ERROR

#: The abort flag of a slot: its sign bit. A slot that carries it is negative, so a plain
#: ``slot >= e`` never takes an abort for an arrival; the count is ``slot & COUNT_MASK``.
ABORT_FLAG = tl.constexpr(cells.ABORT_FLAG)
#: The bits of a slot that count publishes.
COUNT_MASK = tl.constexpr(cells.COUNT_MASK)

#: The flag value that marks a record as a timeout ("SYMMTIME").
TIMED_OUT = tl.constexpr(cells.TIMED_OUT)
#: The flag value that marks a record as an abort seen ("SYMMABRT").
ABORTED = tl.constexpr(cells.ABORTED)
#: Wait statuses: every member arrived; the budget ran out; a member aborted.
ARRIVED, TIMED_OUT_STATUS, ABORTED_STATUS = 0, 1, 2

# The kernels' view of the same facts (compile-time constants). A record is
# [flag, epoch, index, size, slot[size], aborter, reason[REASON_WORDS]]: the aborter's and
# the reason's word indices are a fixed start plus the view size.
_REASON_WORDS = tl.constexpr(cells.REASON_WORDS)
_REASON_LANES = tl.constexpr(triton.next_power_of_2(cells.REASON_WORDS))  # a block covering a reason
_RECORD_FLAG = tl.constexpr(cells.RECORD_FLAG)
_RECORD_EPOCH = tl.constexpr(cells.RECORD_EPOCH)
_RECORD_INDEX = tl.constexpr(cells.RECORD_INDEX)
_RECORD_SIZE = tl.constexpr(cells.RECORD_SIZE)
_RECORD_SLOTS = tl.constexpr(cells.RECORD_SLOTS)
_RECORD_ABORTER = tl.constexpr(cells.record_aborter(0))  # + SIZE
_RECORD_REASON = tl.constexpr(cells.record_reason(0))  # + SIZE
assert all(
    cells.record_aborter(n) - n == cells.record_aborter(0) and cells.record_reason(n) - n == cells.record_reason(0)
    for n in (1, 8, 64)
), "the kernels place the aborter and the reason at a fixed start plus the view size"


@triton.jit
def epoch_ptr(ptrs, cell, me):
    """Pointer to this rank's int64 epoch counter of the cell (in its own memory)."""
    return (tl.load(ptrs + me) + cell + EPOCH).to(tl.pointer_type(tl.int64))


@triton.jit
def _advance_epoch(ptrs, cell, me):
    ep = epoch_ptr(ptrs, cell, me)
    e = tl.load(ep) + 1
    tl.store(ep, e)
    return e


@triton.jit
def peer_ptr(ptrs, index, offset, DTYPE: tl.constexpr):
    """Typed pointer to byte ``offset`` of member ``index``'s memory.

    Pseudocode::

        return (DTYPE*)(ptrs[index] + offset)

    Args:
        ptrs: the view's pointer table (``view.ptrs``; int64 base addresses).
        index: member index in the view (0..SIZE-1), scalar or block.
        offset: byte offset from the member's base, a multiple of DTYPE's size.
        DTYPE: element type of the returned pointer (``tl.float32``, ...).

    Cost: one load from the table (cached), one add. Graph-safe.
    """
    return (tl.load(ptrs + index) + offset).to(tl.pointer_type(DTYPE))


@triton.jit
def translate(ptr, ptrs, from_index, to_index):
    """The address in member ``to_index``'s memory that ``ptr`` has in ``from_index``'s.

    Pseudocode::

        return ptr + (ptrs[to_index] - ptrs[from_index]) / sizeof(*ptr)

    Base addresses are multiples of 16 bytes (page aligned where symmsync allocated; a
    registered base is checked), so the difference is a whole number of elements.
    Cost: two table loads, a subtract. Graph-safe.
    """
    ELEM: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    delta = tl.load(ptrs + to_index) - tl.load(ptrs + from_index)
    return ptr + delta // ELEM


@triton.jit
def publish(ptrs, cell, me, SIZE: tl.constexpr):
    """Advance this rank's epoch and release it to every other member; return the new epoch.

    Pseudocode::

        for p in 0..SIZE-1, p != me:             # thread 0 of the program, none awaited
            red_add_release_sys(&mem[p].cell.slot[me], 1)    # the slot counts publishes
        return ++mem[me].cell.epoch               # device-resident: graph replays advance it

    Contract: every write this rank made before the call (by this thread; by other
    threads of the block once they passed a ``tl.debug_barrier()``; by kernels earlier
    on the stream) is visible to a member that observes its slot >= ``e``. Call it from
    one program per launch (the epoch is this rank's alone), with any ``num_warps``:
    each call adds exactly 1 to each peer's slot; debug mode (:data:`DEBUG`) reports a
    second program of one launch publishing on the channel. Graph-safe.
    Cost: one local load and store, SIZE-1 remote reductions issued back to back and in
    flight together, no reply awaited, nothing sent to itself.
    """
    if _DEBUG:
        _debug_publish(ptrs, cell, me)
    return _publish(ptrs, cell, me, SIZE)


@triton.jit
def _publish(ptrs, cell, me, SIZE: tl.constexpr):
    # publish() without the debug check: grid_fence and grid_sync pick one program per
    # launch themselves, and which one changes from launch to launch.
    # The reductions go first: a release waits for this thread's earlier writes, and the
    # epoch store is one it need not wait for (a slot counts publishes, so the value
    # sent does not depend on the epoch).
    for p in tl.static_range(SIZE):
        dst = (tl.load(ptrs + p) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
        _prims.release_add(dst, p != me)
    return _advance_epoch(ptrs, cell, me)


@triton.jit
def pending(ptrs, cell, me, epoch, SIZE: tl.constexpr):
    """How many other members have not yet published ``epoch`` to this rank (one poll).

    Pseudocode::

        return count(p != me and (load_acquire_sys(&mem[me].cell.slot[p]) & COUNT_MASK) < epoch)

    A member that published ``epoch`` and aborted afterwards counts as arrived: its
    data is valid. One that aborted before it counts as pending here; :func:`wait`
    tells the two apart.
    """
    slots = (tl.load(ptrs + me) + cell + SLOTS).to(tl.pointer_type(tl.int64))
    n = 0
    for base in tl.static_range(0, SIZE, LANES):
        idx = base + tl.arange(0, LANES)
        live = (idx < SIZE) & (idx != me)
        v = _prims.load_acquire(slots + tl.where(idx < SIZE, idx, me))
        n += tl.sum((((v & COUNT_MASK) < epoch) & live).to(tl.int32), axis=0)
    return n


@triton.jit
def _poll(ptrs, cell, me, epoch, SIZE: tl.constexpr):
    # One poll that also reads the abort flags: (members still on their way, members that
    # aborted before publishing ``epoch``). Only the slow path of wait() runs it.
    slots = (tl.load(ptrs + me) + cell + SLOTS).to(tl.pointer_type(tl.int64))
    left = 0
    aborted = 0
    for base in tl.static_range(0, SIZE, LANES):
        idx = base + tl.arange(0, LANES)
        live = (idx < SIZE) & (idx != me)
        v = _prims.load_acquire(slots + tl.where(idx < SIZE, idx, me))
        behind = ((v & COUNT_MASK) < epoch) & live
        left += tl.sum((behind & (v >= 0)).to(tl.int32), axis=0)
        aborted += tl.sum((behind & (v < 0)).to(tl.int32), axis=0)
    return left, aborted


@triton.jit
def wait(ptrs, cell, me, epoch, timeout_ns, SIZE: tl.constexpr):
    """Wait until every other member's slot for this rank counts >= ``epoch``; bounded.

    Pseudocode::

        if pending(epoch) == 0: return 0          # the fast path: one poll, no clock
        start = clock_ns()
        loop:                                     # acquire loads at system scope
            for each member p != me: v = slot[p]
                arrived(p) = (v & COUNT_MASK) >= epoch
                aborted(p) = not arrived(p) and v has ABORT_FLAG
            if any aborted: return 2              # a member gave up: stop at once
            if all arrived: return 0
            if clock_ns() - start > timeout_ns:
                return 1                          # timed out: do NOT read peer data

    Contract: after a 0, reads see every write the members made before they published
    ``epoch`` (see :func:`publish`), even if a member aborted after publishing it. After a
    1 or a 2: a wait that times out or sees an abort fails closed: nothing after it may read
    peer data. Write a record (:func:`write_timeout_record`) and :func:`trap`, or
    report the status to the host. Graph-safe. Cost: one acquire load
    per member per poll and a mask; the first poll usually succeeds when the members are
    in step, and it reads no flag, clock or reason.
    """
    left = pending(ptrs, cell, me, epoch, SIZE)
    aborted = left * 0
    if left > 0:  # the clock and the flags are read only when the first poll did not succeed
        start = _prims.clock_ns()
        elapsed = start - start
        while (left > 0) & (aborted == 0) & (elapsed <= timeout_ns):
            left, aborted = _poll(ptrs, cell, me, epoch, SIZE)
            elapsed = _prims.clock_ns() - start
    return tl.where(aborted > 0, 2, (left > 0).to(tl.int32)).to(tl.int32)


@triton.jit
def write_timeout_record(record, ptrs, cell, me, epoch, SIZE: tl.constexpr):
    """Write what a failed wait saw to ``record`` (int64 words), then a system fence.

    Layout (``symmsync.cells``): ``[flag, epoch, me, SIZE, slot[0], ..., slot[SIZE-1], aborter,
    reason[REASON_WORDS]]``.
    ``flag`` is :data:`ABORTED` when a member below ``epoch`` carries the abort flag (then
    ``aborter`` is the first such member's index and ``reason`` the words of its own cell's
    reason, read through the pointer table), else :data:`TIMED_OUT` (``aborter`` is -1).
    Slots are raw: count and flag. The host turns the record into a
    :class:`~symmsync.FenceTimeout` (or :class:`~symmsync.PeerAborted`) that names the
    late or aborted members; on a GPU it is pinned host memory, read after the trap.
    """
    slots = (tl.load(ptrs + me) + cell + SLOTS).to(tl.pointer_type(tl.int64))
    rec = record.to(tl.pointer_type(tl.int64))
    first = SIZE + (me * 0)
    for base in tl.static_range(0, SIZE, LANES):
        idx = base + tl.arange(0, LANES)
        v = _prims.load_acquire(slots + tl.where(idx < SIZE, idx, me))
        gone = (idx < SIZE) & (idx != me) & ((v & COUNT_MASK) < epoch) & (v < 0)
        first = tl.minimum(first, tl.min(tl.where(gone, idx, SIZE), axis=0))
        tl.store(rec + _RECORD_SLOTS + idx, tl.where(idx == me, epoch, v), mask=idx < SIZE)
    # The flag was seen by one thread's acquire load; the reason is read by others: the
    # barrier and the fence order those reads after that load (cumulativity).
    tl.debug_barrier()
    _prims.memory_barrier_sys()
    w = tl.arange(0, _REASON_LANES)
    found = first < SIZE
    src = (tl.load(ptrs + tl.where(found, first, me)) + cell + REASON).to(tl.pointer_type(tl.int64))
    words = _prims.load_acquire(src + tl.where(w < _REASON_WORDS, w, 0))
    tl.store(rec + _RECORD_REASON + SIZE + w, tl.where(found, words, 0), mask=w < _REASON_WORDS)
    tl.store(rec + _RECORD_ABORTER + SIZE, tl.where(found, first, -1))
    tl.store(rec + _RECORD_EPOCH, epoch)
    tl.store(rec + _RECORD_INDEX, me)
    tl.store(rec + _RECORD_SIZE, SIZE)
    tl.store(rec + _RECORD_FLAG, tl.where(found, ABORTED, TIMED_OUT))
    tl.debug_barrier()  # every warp's part of the record is written before any thread traps
    _prims.memory_barrier_sys()


@triton.jit
def mark_abort(ptrs, cell, me, reason, SIZE: tl.constexpr):
    """Tell every other member that this rank gave up on the cell's channel.

    Pseudocode::

        mem[me].cell.reason[:REASON_WORDS] = reason[:REASON_WORDS]   # code, length, UTF-8 text
        block_barrier()
        for p in 0..SIZE-1, p != me:                   # thread 0
            red_or_release_sys(&mem[p].cell.slot[me], ABORT_FLAG)

    Contract: a member whose wait observes the flag also observes the reason. The count
    bits are untouched, so a member that already saw this rank's publish of an epoch
    still completes its wait for it; a member waiting for a later epoch returns 2 from
    :func:`wait` within one poll. Idempotent (an OR). ``reason`` points at
    :data:`REASON_WORDS` int64 words. Run it from one program, on a stream that is not
    blocked behind this rank's own waits. Cost: REASON_WORDS local stores, SIZE-1 remote
    reductions.
    """
    own = (tl.load(ptrs + me) + cell + REASON).to(tl.pointer_type(tl.int64))
    w = tl.arange(0, _REASON_LANES)
    src = reason.to(tl.pointer_type(tl.int64))
    tl.store(own + w, tl.load(src + w, mask=w < _REASON_WORDS), mask=w < _REASON_WORDS)
    tl.debug_barrier()
    for p in tl.static_range(SIZE):
        dst = (tl.load(ptrs + p) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
        _prims.release_or(dst, ABORT_FLAG, p != me)


@triton.jit
def trap():
    """Stop the kernel and the stream (GPU); the host sees a CUDA error. No-op on the host
    backend, where the wait's status reaches the host instead."""
    _prims.trap()


@triton.jit
def clock_ns():
    """Nanoseconds from a monotonic clock, as an int64 scalar: the clock of :func:`wait`'s budget.

    GPU: the global timer (``%globaltimer``), the same on every SM of a device;
    interpreter: ``time.monotonic_ns()``. Use differences, not absolute values. Cost: one
    register read (GPU). Graph-safe.
    """
    return _prims.clock_ns()


@triton.jit
def publish_and_wait(ptrs, cell, me, timeout_ns, SIZE: tl.constexpr):
    """:func:`publish` then :func:`wait` for the new epoch; returns the wait status.

    Pseudocode::

        e = publish(); return wait(e)

    Contract: on 0, every member reached this point and all their writes before it are
    visible here. Call it from one program (or use :func:`grid_fence`), after a
    ``tl.debug_barrier()`` when other threads wrote the payload. Graph-safe.
    """
    e = publish(ptrs, cell, me, SIZE)
    return wait(ptrs, cell, me, e, timeout_ns, SIZE)


@triton.jit
def wait_or_trap(ptrs, cell, me, epoch, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """:func:`wait` for ``epoch``; on a timeout or an abort write ``record`` and, if
    ``TRAP``, :func:`trap`.

    Returns the wait status (0: arrived, 1: timed out, 2: a member aborted). With
    ``TRAP`` (the GPU default) a failed kernel never returns, so nothing downstream on
    the stream runs on stale data; the record is written before the trap, because the
    CUDA context is unusable after it.
    """
    status = wait(ptrs, cell, me, epoch, timeout_ns, SIZE)
    if status != 0:
        write_timeout_record(record, ptrs, cell, me, epoch, SIZE)
        if TRAP:
            trap()
    return status


@triton.jit
def grid_fence(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """A whole fence at the tail of a multi-program kernel, with no extra launch.

    Every program calls it after its last write to peer memory. The last program to
    arrive advances the epoch, publishes it and waits; the kernel ends only after
    every member arrived, so kernels after it on the stream read complete data.

    Pseudocode::

        block_barrier()                                    # this program's writes first
        n = atomic_add_acq_rel_sys(&mem[me].cell.arrivals, 1)
        if n == num_programs - 1:                          # last one in
            mem[me].cell.arrivals = 0                      # ready for the next launch
            e = publish(); wait_or_trap(e)

    Why it is correct: each program's peer writes precede its release (acq_rel, system
    scope) on the arrival counter; the last program acquires every earlier increment;
    the block barrier that hands the counter's value to its other threads orders that
    acquire before the release reductions of :func:`publish` (issued by thread 0), and
    release is cumulative over that chain, so a member that observes its slot at ``e`` observes
    every program's writes. (The Spin model in ``verify/`` covers single-program
    fences, not this multi-program arrival.) Graph-safe. Cost: one local atomic per
    program, one publish and one wait in total. Returns the wait status (last
    program) or 0.
    """
    tl.debug_barrier()
    counter = (tl.load(ptrs + me) + cell + ARRIVALS).to(tl.pointer_type(tl.int64))
    nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    n = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
    status = (n * 0).to(tl.int32)
    if n == nprog - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        e = _publish(ptrs, cell, me, SIZE)
        status = wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)
    return status


@triton.jit
def grid_sync(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """A whole fence in which every program of a multi-program kernel waits: afterwards every
    program may read what the members wrote before their own ``grid_sync``, in the same launch.

    Every program calls it, after its last write to peer memory. The last program to arrive
    publishes the next epoch; every program then waits for the members' publish of it.

    Pseudocode::

        block_barrier()                                    # this program's writes first
        e = mem[me].cell.epoch + 1                         # read before arriving: see below
        n = atomic_add_acq_rel_sys(&mem[me].cell.arrivals, 1)
        if n == num_programs - 1:                          # last one in
            mem[me].cell.arrivals = 0
            publish()                                      # advances the epoch to e
        return wait_or_trap(e)                             # every program

    Why it is correct: each program reads the epoch before its arrival (a release), and the
    last program advances it only after acquiring every arrival, so every program reads the
    epoch of before the launch and waits for the same ``e``. The publish is released after
    every program's writes (as in :func:`grid_fence`), and each program's acquire of the
    members' slots at ``e`` makes their writes before their ``grid_sync`` visible to it.
    Writes of this rank's other programs are not covered (they need no fence: use the
    launch's own order, or a second kernel). (The Spin models in ``verify/`` do not cover
    this multi-program arrival, as they do not cover :func:`grid_fence`'s.)

    Co-residency: every program of the launch must be resident on the device at once,
    because the early ones spin until the last one has arrived (and so have the members'
    last ones); a grid larger than the device holds would spin until the budget runs out.
    Launch it with :func:`symmsync.launch_grid_sync`, which checks the grid against the
    device's occupancy for the compiled kernel (GPU) and refuses more than one program on
    the host backend, whose interpreter runs programs one after another (a launch of more
    programs made some other way raises there too). Graph-safe. Cost: one local atomic per
    program, one publish, one wait per program. Returns the wait status.
    """
    _prims.check_co_resident()
    tl.debug_barrier()
    e = tl.load(epoch_ptr(ptrs, cell, me)) + 1
    counter = (tl.load(ptrs + me) + cell + ARRIVALS).to(tl.pointer_type(tl.int64))
    nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    n = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
    if n == nprog - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        _publish(ptrs, cell, me, SIZE)
    return wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)


# ---------------------------------------------------------------------- debug checks
_STAMP_SHIFT = tl.constexpr(24)  # a debug stamp: launch number above, program index below
_STAMP_PROGRAM = tl.constexpr((1 << 24) - 1)


@triton.jit
def _program_index():
    return tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))


@triton.jit
def _debug_publish(ptrs, cell, me):
    # Slot ``me`` of this rank's own cell is a word no protocol uses (a rank never publishes
    # to itself): debug mode keeps there the launch and the program of the last publish. A
    # publish by another program of the same launch is the misuse; the same program
    # publishing again (or in a replay of the same graph node) is not.
    mine = (tl.load(ptrs + me) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
    pid = _program_index().to(tl.int64)
    stamp = ((_prims.launch_id() + 1) << _STAMP_SHIFT) | pid
    old = tl.atomic_xchg(mine, stamp, sem="relaxed", scope="gpu")
    bad = ((old >> _STAMP_SHIFT) == (stamp >> _STAMP_SHIFT)) & ((old & _STAMP_PROGRAM) != pid)
    _prims.debug_fail(bad, 0, me, cell)


@triton.jit
def _debug_offsets(sig, offset, mask, ELEM: tl.constexpr):
    # Every live lane's bytes [offset, offset + ELEM) must lie in the user region. (Masks are
    # combined as ints: the interpreter mishandles a boolean block broadcast with a scalar.)
    nbytes = tl.load(sig + _HANDLE_NBYTES)
    off = offset + tl.zeros([1], tl.int64)
    live = (mask + tl.zeros([1], tl.int32)) != 0
    bad = ((off < 0) | (off + ELEM > nbytes)).to(tl.int32) * live.to(tl.int32)
    worst = tl.max(tl.where(bad != 0, off, -(2**62)), axis=None)
    _prims.debug_fail(tl.max(bad, axis=None) > 0, 1, tl.load(sig + _HANDLE_RANK), worst)


@triton.jit
def _debug_target(sig, peer, slot, NSLOTS: tl.constexpr):
    size = tl.load(sig + _HANDLE_SIZE)
    bad_peer = (peer < 0) | (peer >= size)
    bad = bad_peer | (slot < 0) | (slot >= NSLOTS)
    _prims.debug_fail(bad, 2, tl.load(sig + _HANDLE_RANK), tl.where(bad_peer, peer, slot))


# ---------------------------------------------------------------------- point-to-point signals
#: Signal operations (``OP`` of :func:`signal`): add the value; store it.
ADD = tl.constexpr(0)
SET = tl.constexpr(1)
#: Comparisons of :func:`wait_signal` (``CMP``): slot == value, !=, >=, >, <=, <.
EQ = tl.constexpr(0)
NE = tl.constexpr(1)
GE = tl.constexpr(2)
GT = tl.constexpr(3)
LE = tl.constexpr(4)
LT = tl.constexpr(5)
assert [EQ.value, NE.value, GE.value, GT.value, LE.value, LT.value] == [
    cells.CMP_NAMES.index(n) for n in ("EQ", "NE", "GE", "GT", "LE", "LT")
]

_HANDLE_NBYTES = tl.constexpr(cells.HANDLE_NBYTES)
_HANDLE_RANK = tl.constexpr(cells.HANDLE_RANK)
_HANDLE_SIZE = tl.constexpr(cells.HANDLE_SIZE)
_HANDLE_BASES = tl.constexpr(cells.HANDLE_BASES)
_HANDLE_INBOX = tl.constexpr(cells.HANDLE_INBOX)
_SREC_INDEX = tl.constexpr(cells.SREC_INDEX)
_SREC_PEER = tl.constexpr(cells.SREC_PEER)
_SREC_SLOT = tl.constexpr(cells.SREC_SLOT)
_SREC_CMP = tl.constexpr(cells.SREC_CMP)
_SREC_COUNTED = tl.constexpr(cells.SREC_COUNTED)
_SREC_VALUE = tl.constexpr(cells.SREC_VALUE)
_SREC_BASE = tl.constexpr(cells.SREC_BASE)
_SREC_OBSERVED = tl.constexpr(cells.SREC_OBSERVED)
_SREC_ABORTER = tl.constexpr(cells.SREC_ABORTER)
_SREC_REASON = tl.constexpr(cells.SREC_REASON)
assert cells.SREC_FLAG == 0 and cells.handle_data(7) == cells.HANDLE_INBOX + 7
assert cells.handle_cell(7) == cells.HANDLE_INBOX + 14


@triton.jit
def _slot_ptr(sig, owner, sender, slot, NSLOTS: tl.constexpr):
    # inbox[sender][slot] in member ``owner``'s signal memory
    return (tl.load(sig + _HANDLE_INBOX + owner) + (sender * NSLOTS + slot) * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def _base_ptr(sig, peer, slot, NSLOTS: tl.constexpr):
    # base[peer][slot] in this member's own signal memory
    return (tl.load(sig + _HANDLE_BASES) + (peer * NSLOTS + slot) * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def signal(sig, me, peer, slot, value, OP: tl.constexpr, NSLOTS: tl.constexpr):
    """Add ``value`` to (``ADD``), or store it in (``SET``), slot ``slot`` that this rank has at
    member ``peer``; released at system scope.

    Pseudocode::

        dst = &mem[peer].inbox[me][slot]                   # int64
        if OP == ADD: red_add_release_sys(dst, value)      # thread 0 of the program
        else:         st_release_sys(dst, value)

    Contract: every write this rank made before the call (by this thread; by the block's
    other threads once they passed a ``tl.debug_barrier()``; by kernels earlier on the
    stream) is visible to ``peer`` once it observes the value this call produced (with
    :func:`wait_signal`, :func:`wait_count` or :func:`read_signal`: acquire loads). Exactly
    once per call for a program of any ``num_warps``. Use ``ADD`` for counters (replay
    safe with :func:`wait_count`), ``SET`` for flags and sequence numbers the kernel computes
    on the device. Graph-safe. Cost: one remote reduction (ADD) or store (SET), no reply
    awaited, one load from the handle.

    Args:
        sig: the handle (``Signals.kernel_args[0]``).
        me: this rank's index in the view (``Signals.kernel_args[1]``).
        peer: the member to signal (0..SIZE-1; itself too).
        slot: which of its slots (0..NSLOTS-1).
        value: int64 to add or store.
        OP: :data:`ADD` or :data:`SET`.
        NSLOTS: the object's slots per peer (``Signals.slots``).
    """
    if _DEBUG:
        _debug_target(sig, peer, slot, NSLOTS)
    dst = _slot_ptr(sig, peer, me, slot, NSLOTS)
    if OP == SET:
        _prims.signal_set(dst, value)
    else:
        _prims.signal_add(dst, value)


@triton.jit
def read_signal(sig, me, peer, slot, NSLOTS: tl.constexpr):
    """The value of the slot ``peer`` signals this rank on (one acquire load at system scope).

    Pseudocode::

        return load_acquire_sys(&mem[me].inbox[peer][slot])

    Reads after it see every write ``peer`` made before the signal that produced the value
    read. Graph-safe. Cost: one load from the handle, one acquire load.
    """
    return _prims.load_acquire(_slot_ptr(sig, me, peer, slot, NSLOTS))


@triton.jit
def _compare(v, value, CMP: tl.constexpr):
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
def _aborted_members(sig, me, SIZE: tl.constexpr):
    # How many other members carry an abort flag in this rank's channel-0 cell of the view.
    own = (tl.load(sig + _HANDLE_INBOX + 2 * SIZE + me) + SLOTS).to(tl.pointer_type(tl.int64))
    n = 0
    for base in tl.static_range(0, SIZE, LANES):
        idx = base + tl.arange(0, LANES)
        live = (idx < SIZE) & (idx != me)
        v = _prims.load_acquire(own + tl.where(idx < SIZE, idx, me))
        n += tl.sum(((v < 0) & live).to(tl.int32), axis=0)
    return n


@triton.jit
def _wait_until(src, target, CMP: tl.constexpr, sig, me, timeout_ns, SIZE: tl.constexpr):
    # (status, the value last observed): 0 once *src CMP target, 2 when a member aborted
    # first, 1 when the budget ran out first. The flags and the clock are read only when the
    # first poll did not succeed.
    v = _prims.load_acquire(src)
    ok = _compare(v, target, CMP)
    aborted = ok * 0
    if ok == 0:
        start = _prims.clock_ns()
        elapsed = start - start
        while (ok == 0) & (aborted == 0) & (elapsed <= timeout_ns):
            v = _prims.load_acquire(src)
            ok = _compare(v, target, CMP)
            aborted = _aborted_members(sig, me, SIZE)
            elapsed = _prims.clock_ns() - start
    return tl.where(ok != 0, 0, tl.where(aborted > 0, 2, 1)).to(tl.int32), v


@triton.jit
def _write_signal_record(
    record, sig, me, peer, slot, value, base, observed, CMP: tl.constexpr, COUNTED: tl.constexpr, SIZE: tl.constexpr
):
    # The layout is symmsync.cells' (SREC_*); the flag goes last, after a system fence.
    own = (tl.load(sig + _HANDLE_INBOX + 2 * SIZE + me) + SLOTS).to(tl.pointer_type(tl.int64))
    rec = record.to(tl.pointer_type(tl.int64))
    first = SIZE + (me * 0)
    for b in tl.static_range(0, SIZE, LANES):
        idx = b + tl.arange(0, LANES)
        v = _prims.load_acquire(own + tl.where(idx < SIZE, idx, me))
        gone = (idx < SIZE) & (idx != me) & (v < 0)
        first = tl.minimum(first, tl.min(tl.where(gone, idx, SIZE), axis=0))
    # As in write_timeout_record: the reason is read after the flag that announced it.
    tl.debug_barrier()
    _prims.memory_barrier_sys()
    w = tl.arange(0, _REASON_LANES)
    found = first < SIZE
    src = (tl.load(sig + _HANDLE_INBOX + 2 * SIZE + tl.where(found, first, me)) + REASON).to(tl.pointer_type(tl.int64))
    words = _prims.load_acquire(src + tl.where(w < _REASON_WORDS, w, 0))
    tl.store(rec + _SREC_REASON + w, tl.where(found, words, 0), mask=w < _REASON_WORDS)
    tl.store(rec + _SREC_ABORTER, tl.where(found, first, -1))
    tl.store(rec + _SREC_INDEX, me)
    tl.store(rec + _SREC_PEER, peer)
    tl.store(rec + _SREC_SLOT, slot)
    tl.store(rec + _SREC_CMP, CMP)
    tl.store(rec + _SREC_COUNTED, COUNTED)
    tl.store(rec + _SREC_VALUE, value)
    tl.store(rec + _SREC_BASE, base)
    tl.store(rec + _SREC_OBSERVED, observed)
    tl.store(rec, tl.where(found, ABORTED, TIMED_OUT))
    tl.debug_barrier()  # every warp's part of the record is written before any thread traps
    _prims.memory_barrier_sys()


@triton.jit
def wait_signal(
    sig,
    me,
    peer,
    slot,
    value,
    CMP: tl.constexpr,
    timeout_ns,
    record,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    """Wait until the slot ``peer`` signals this rank on compares ``CMP`` to ``value``; bounded.

    Pseudocode::

        loop:                                              # acquire loads, system scope
            v = mem[me].inbox[peer][slot]
            if v CMP value: return 0
            if a member's abort flag is set: break         # status 2, within a poll
            if clock_ns() - start > timeout_ns: break      # status 1
        write the record: this rank, peer, slot, CMP, value, v, the aborter and its reason
        if TRAP: trap()                                    # GPU: the stream stops
        return status

    Contract: after a 0, reads see every write ``peer`` made before the signal that
    produced the value observed (release/acquire at system scope). After a 1 or a 2: a wait
    that times out or sees an abort fails closed: nothing after it may read peer data. The
    record is written (``Signals.check()`` raises
    :class:`~symmsync.SignalTimeout` or :class:`~symmsync.SignalAborted` from it) and, with
    ``TRAP``, the kernel never returns. The comparison is absolute: a slot that only grows
    (``ADD``) compared with ``GE`` against a value computed on the device (a device epoch,
    say) is replay safe; against a constant it is not (a second replay sees the first's
    counts): use :func:`wait_count` for counters. The budget and clock are :func:`wait`'s.
    Graph-safe. Cost: one acquire load per poll; the flags and the clock only after a first
    poll that did not succeed.

    Args:
        sig: the handle (``Signals.kernel_args[0]``).
        me: this rank's index in the view (``Signals.kernel_args[1]``).
        peer: whose slot (a view index).
        slot: which of its slots.
        value: the int64 compared with.
        CMP: :data:`EQ`, :data:`NE`, :data:`GE`, :data:`GT`, :data:`LE` or :data:`LT`.
        timeout_ns: the budget (``Signals.kernel_args[2]``).
        record: the record's address (``Signals.kernel_args[3]``).
        SIZE: ``Signals.size``.
        NSLOTS: ``Signals.slots``.
        TRAP: trap after the record (``Signals.traps``: the GPU default).
    """
    if _DEBUG:
        _debug_target(sig, peer, slot, NSLOTS)
    status, v = _wait_until(_slot_ptr(sig, me, peer, slot, NSLOTS), value, CMP, sig, me, timeout_ns, SIZE)
    if status != 0:
        _write_signal_record(record, sig, me, peer, slot, value, v * 0, v, CMP, 0, SIZE)
        if TRAP:
            trap()
    return status


@triton.jit
def wait_count(
    sig,
    me,
    peer,
    slot,
    count,
    timeout_ns,
    record,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    """Wait until ``count`` more signals (``ADD`` of 1 each, or adds summing to ``count``)
    arrived from ``peer`` on ``slot`` than earlier counted waits consumed; then consume them.

    Pseudocode::

        b = mem[me].base[peer][slot]                      # device-resident, this rank's alone
        status = wait until mem[me].inbox[peer][slot] >= b + count   (as wait_signal, GE)
        if status == 0: mem[me].base[peer][slot] = b + count
        else: record (counted: count, base b, the value observed); trap if TRAP

    Contract: as :func:`wait_signal` with ``GE`` against ``b + count``. Replay safe: the base
    lives in device memory and only this rank's counted waits advance it, so a kernel that
    signals ``k`` times and one that waits ``k`` times, each captured once in a CUDA graph,
    stay in step over any number of replays with no reset: a producer ahead of the consumer
    is harmless (it is ``>=``, never ``==``). Call it from one program per (peer, slot) and
    launch. Graph-safe. Cost: one local load and store, then :func:`wait_signal`'s.
    """
    if _DEBUG:
        _debug_target(sig, peer, slot, NSLOTS)
    bp = _base_ptr(sig, peer, slot, NSLOTS)
    b = tl.load(bp)
    status, v = _wait_until(_slot_ptr(sig, me, peer, slot, NSLOTS), b + count, GE, sig, me, timeout_ns, SIZE)
    # Every thread loaded the base before any stores the new one (a lagging warp would
    # otherwise read it advanced and wait for twice the count).
    tl.debug_barrier()
    tl.store(bp, tl.where(status == 0, b + count, b))
    if status != 0:
        _write_signal_record(record, sig, me, peer, slot, count, b, v, GE, 1, SIZE)
        if TRAP:
            trap()
    return status


@triton.jit
def data_ptr(sig, peer, offset, DTYPE: tl.constexpr):
    """Typed pointer to byte ``offset`` of member ``peer``'s user region, through a Signals handle.

    :func:`peer_ptr` for the table in the handle (the view's ``ptrs``). ``offset`` may be a
    block (one byte offset per lane). In debug mode (:data:`DEBUG`) every lane's bytes must
    lie inside the view's user region, or the kernel reports the rank, the program and the
    offset (keep masked-off lanes' offsets in range, or use :func:`put_signal`, which checks
    only live lanes). Graph-safe. Cost: two loads from the handle (cached), one add.
    """
    if _DEBUG:
        _debug_offsets(sig, offset, 1, DTYPE.primitive_bitwidth // 8)
    size = tl.load(sig + _HANDLE_SIZE)
    return (tl.load(sig + _HANDLE_INBOX + size + peer) + offset).to(tl.pointer_type(DTYPE))


@triton.jit
def put_signal(sig, me, peer, offset, values, mask, slot, NSLOTS: tl.constexpr):
    """Store a tile into ``peer``'s user region, then add 1 to the slot this rank has there.

    Pseudocode::

        store(mem[peer].data + offset, values, mask)       # every thread its lanes
        block_barrier()                                    # the whole tile before the release
        red_add_release_sys(&mem[peer].inbox[me][slot], 1) # thread 0

    Contract: ``peer`` sees the whole tile once it observes the slot's new count (its
    :func:`wait_count` of 1 returns 0, or its :func:`wait_signal` sees it): the block
    barrier inside orders every thread's stores before thread 0's release, which is
    cumulative. ``offset`` is a block of byte offsets (one per lane, shaped like
    ``values``, multiples of the element size), ``mask`` which lanes store. Call it from a
    whole program (every thread reaches the barrier). A ring of tiles reused by the
    producer needs credits from the consumer (a signal back, as in the tutorial). In debug
    mode every live lane must lie inside the user region. Graph-safe. Cost: the stores, a
    block barrier, one remote reduction.
    """
    ELEM: tl.constexpr = values.dtype.primitive_bitwidth // 8
    if _DEBUG:
        _debug_offsets(sig, offset, mask, ELEM)
        _debug_target(sig, peer, slot, NSLOTS)
    size = tl.load(sig + _HANDLE_SIZE)
    dst = (tl.load(sig + _HANDLE_INBOX + size + peer) + offset).to(tl.pointer_type(values.dtype))
    tl.store(dst, values, mask=mask)
    tl.debug_barrier()
    _prims.signal_add(_slot_ptr(sig, peer, me, slot, NSLOTS), 1)
