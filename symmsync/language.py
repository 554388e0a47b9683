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

__all__ = [
    "ABORTED",
    "ABORTED_STATUS",
    "ABORT_FLAG",
    "ADD",
    "ARRIVALS",
    "ARRIVED",
    "COUNT_MASK",
    "DEBUG",
    "EPOCH",
    "EQ",
    "GE",
    "GT",
    "INTERPRETED",
    "LANES",
    "LE",
    "LT",
    "NE",
    "REASON",
    "REASON_CLOSED",
    "REASON_ERROR",
    "REASON_TEXT_BYTES",
    "REASON_WORDS",
    "SET",
    "SLOTS",
    "TIMED_OUT",
    "TIMED_OUT_STATUS",
    "clock_ns",
    "data_ptr",
    "epoch_ptr",
    "grid_fence",
    "grid_sync",
    "mark_abort",
    "peer_ptr",
    "pending",
    "publish",
    "publish_and_wait",
    "put_signal",
    "read_signal",
    "record_barrier",
    "signal",
    "translate",
    "trap",
    "wait",
    "wait_count",
    "wait_or_trap",
    "wait_signal",
    "write_timeout_record",
]

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
    _release_slots(ptrs, cell, me, SIZE)
    return _advance_epoch(ptrs, cell, me)


@triton.jit
def _release_slots(ptrs, cell, me, SIZE: tl.constexpr):
    # The release reductions of a publish: one to each other member's slot for this rank.
    for p in tl.static_range(SIZE):
        dst = (tl.load(ptrs + p) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
        _prims.release_add(dst, p != me)


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
def record_barrier():
    """A fence at system scope in every thread, for records the host reads (GPU: ``fence.sc.sys``).

    Pseudocode::

        fence_sc_sys()                 # every thread; nothing on the host backend

    Contract: this thread's writes before it are performed for every observer, the host
    reading pinned memory included, before its writes after it; and before a
    :func:`trap` that follows it, since the fence waits for them. Write a record's words,
    ``tl.debug_barrier()``, ``record_barrier()``, its flag word, ``record_barrier()``,
    then trap: the host that sees the flag sees the words, and the flag is not lost to the
    trap (:func:`write_timeout_record` writes its record so). Use plain stores for
    records in pinned host memory: a GPU atomic on host memory needs PCIe atomics, which
    a machine may lack. Cost: a system fence per thread. Graph-safe.
    """
    _prims.memory_barrier_sys()


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

        if SIZE == 1:                                      # a view of this rank alone
            program 0: ++mem[me].cell.epoch; return 0      # stream order is the whole fence
        block_barrier()                                    # this program's writes first
        e = mem[me].cell.epoch + 1                         # read before arriving
        n = atomic_add_acq_rel_gpu(&mem[me].cell.arrivals, 1)
        if n == num_programs - 1:                          # last one in
            mem[me].cell.arrivals = 0                      # ready for the next launch
            publish(e); wait_or_trap(e)                    # publish() storing epoch e

    Why it is correct: each program's writes, to peers' memory or its own, precede its
    release on the arrival counter; the last program acquires every earlier increment;
    the block barrier that hands the counter's value to its other threads orders that
    acquire before the release reductions of :func:`publish` (issued by thread 0), and
    release is cumulative over that chain, so a member that observes its slot at ``e``
    observes every program's writes. The arrivals need only GPU scope: the programs that
    synchronize through the counter all run on this GPU, and causality order is
    transitive across scopes (each link is morally strong: GPU scope between this GPU's
    programs, system scope between the publish and a member's acquire). System-scope
    arrivals cost 0.7–1.0 µs more per launch on an H200 with 1024–2048 programs
    (docs/performance.md, "The PCP writer on one GPU"). Each program reads the epoch before it arrives, and
    only the last advances it, after acquiring every arrival, so the last one's ``e`` is
    the epoch before the launch plus one. A view of one member has nobody to tell: its
    kernels after this launch see its writes by stream order, so the tail only advances
    the epoch (as a fence of one member's does), at no cost. (The Spin model in
    ``verify/`` covers single-program fences, not this multi-program arrival.)
    Graph-safe. Cost: one GPU-scope atomic per program, one publish and one wait in
    total (with one member: one load and store). Returns the wait status (last program)
    or 0.
    """
    ep = epoch_ptr(ptrs, cell, me)
    status = (me * 0).to(tl.int32)
    if SIZE == 1:
        # A view of one member: nobody to publish to or wait for, and stream order shows
        # this launch's writes to the kernels after it. The epoch advances as in any fence.
        if tl.program_id(0) + tl.program_id(1) + tl.program_id(2) == 0:
            tl.store(ep, tl.load(ep) + 1)
    else:
        tl.debug_barrier()
        # Read before arriving (the load overlaps the arrival): only the last program
        # advances the epoch, after every program arrived.
        e = tl.load(ep) + 1
        counter = (tl.load(ptrs + me) + cell + ARRIVALS).to(tl.pointer_type(tl.int64))
        nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        n = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if n == nprog - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            _release_slots(ptrs, cell, me, SIZE)
            tl.store(ep, e)
            status = wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)
    return status


# The grid-wide wait, the point-to-point signals and the debug checks live in their own source file; their
# contract is the ``signals-contract`` block above. Imported last: that module takes the
# constants and primitives defined here.
from ._language_signals import (  # noqa: E402
    ADD,
    EQ,
    GE,
    GT,
    LE,
    LT,
    NE,
    SET,
    _debug_publish,
    data_ptr,
    grid_sync,
    put_signal,
    read_signal,
    signal,
    wait_count,
    wait_signal,
)
