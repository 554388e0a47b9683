"""The fence's device code: publish, wait, abort, and the grid-wide fences (grid_fence, grid_sync).

Kernels call them as ``symmsync.language.publish``, ``wait``, ...: this module holds their
source, :mod:`symmsync.language` exports them and states their contract (its ``contract``
block). The arrival counter, the bounded poll and the scan of the members' slots they use
are :mod:`symmsync.language.core`'s; the timeout record is :mod:`symmsync.language.records`'s.
Import :mod:`symmsync.language`, not this module.

Every primitive that takes a member index (``me``) checks ``0 <= me < SIZE`` on every call
(:func:`symmsync.language.records.check_index`): those that take a ``record`` (wait_or_trap,
grid_fence, grid_sync) write an index record there first; all then report it (the
interpreter raises :class:`~symmsync.IndexCheckError`; a GPU kernel prints it and traps).
:func:`peer_ptr` and :func:`translate` take no size and are unchecked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .core import (
    _CLOSED_EPOCH,
    _DEBUG,
    _REASON_LANES,
    _REASON_WORDS,
    ABORT_FLAG,
    ARRIVALS,
    BEHIND,
    GE,
    MEMBERS,
    REASON,
    SLOTS,
    _prims,
    _publish,
    arrive,
    bounded_poll,
    epoch_ptr,
    program_index,
    scan_members,
    slots_ptr,
)
from .records import (
    MEMBER,
    P_GRID_FENCE,
    P_GRID_SYNC,
    P_MARK_ABORT,
    P_PENDING,
    P_PUBLISH,
    P_PUBLISH_AND_WAIT,
    P_WAIT,
    P_WAIT_OR_TRAP,
    check_index,
    write_timeout_record,
)


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

    Unchecked: ``index`` is not compared with the view's size (the table carries none), so
    an index out of range reads past the table. :func:`data_ptr` is the checked form (through
    a :class:`~symmsync.Signals` handle, which knows the size). Cost: one load from the table
    (cached), one add. Graph-safe.
    """
    return (tl.load(ptrs + index) + offset).to(tl.pointer_type(DTYPE))


@triton.jit
def translate(ptr, ptrs, from_index, to_index):
    """The address in member ``to_index``'s memory that ``ptr`` has in ``from_index``'s.

    Pseudocode::

        return ptr + (ptrs[to_index] - ptrs[from_index]) / sizeof(*ptr)

    Base addresses are multiples of 16 bytes (page aligned where symmsync allocated; a
    registered base is checked), so the difference is a whole number of elements.
    Unchecked, as :func:`peer_ptr` is: keep both indices in ``[0, SIZE)``.
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
    flight together, no reply awaited, nothing sent to itself. ``me`` is checked on every
    call (``0 <= me < SIZE``: :func:`symmsync.language.records.check_index`).
    """
    check_index(me, SIZE, 0, -1, P_PUBLISH, MEMBER, False)
    if _DEBUG:
        _debug_publish(ptrs, cell, me)
    return _publish(ptrs, cell, me, SIZE)


@triton.jit
def pending(ptrs, cell, me, epoch, SIZE: tl.constexpr):
    """How many other members have not yet published ``epoch`` to this rank (one poll).

    Pseudocode::

        return count(p != me and (load_acquire_sys(&mem[me].cell.slot[p]) & COUNT_MASK) < epoch)

    A member that published ``epoch`` and aborted afterwards counts as arrived: its
    data is valid. One that aborted before it counts as pending here; :func:`wait`
    tells the two apart. ``me`` is checked on every call.
    """
    check_index(me, SIZE, 0, -1, P_PENDING, MEMBER, False)
    n, _unused = scan_members(slots_ptr(ptrs, cell, me), me, epoch, ptrs, SIZE, BEHIND)
    return n


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
    in step, and it reads no flag, clock or reason. (symmsync's one bounded poll,
    :func:`symmsync.language.core.bounded_poll`, on the members' slots.) A wait for an
    epoch at or past the one ``close()`` stores (through arguments kept past close) returns
    2 at its first poll, whatever the slots hold. ``me`` is checked on every call.
    """
    check_index(me, SIZE, 0, -1, P_WAIT, MEMBER, False)
    return _wait(ptrs, cell, me, epoch, timeout_ns, SIZE)


@triton.jit
def _wait(ptrs, cell, me, epoch, timeout_ns, SIZE: tl.constexpr):
    # wait() after its check. close() stores CLOSED_EPOCH as this rank's epoch, so a wait for
    # an epoch at or past it runs through arguments kept past close: its first poll fails
    # whatever it saw (a slot that garbage or an overrun pushed past the epoch must not pass it).
    closed = tl.full((), 0, tl.int64) + epoch >= _CLOSED_EPOCH  # int64: a launch may pass an int32 epoch
    status, _left = bounded_poll(ptrs, epoch, ptrs, cell, me, timeout_ns, SIZE, MEMBERS, GE, closed)
    return status


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
    reductions. ``me`` is checked on every call.
    """
    check_index(me, SIZE, 0, -1, P_MARK_ABORT, MEMBER, False)
    own = (tl.load(ptrs + me) + cell + REASON).to(tl.pointer_type(tl.int64))
    w = tl.arange(0, _REASON_LANES)
    src = reason.to(tl.pointer_type(tl.int64))
    tl.store(own + w, tl.load(src + w, mask=w < _REASON_WORDS), mask=w < _REASON_WORDS)
    tl.debug_barrier()
    for p in tl.static_range(SIZE):
        dst = (tl.load(ptrs + p) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
        _prims.release_or(dst, ABORT_FLAG, p != me)


@triton.jit
def publish_and_wait(ptrs, cell, me, timeout_ns, SIZE: tl.constexpr):
    """:func:`publish` then :func:`wait` for the new epoch; returns the wait status.

    Pseudocode::

        e = publish(); return wait(e)

    Contract: on 0, every member reached this point and all their writes before it are
    visible here. Call it from one program (or use :func:`grid_fence`), after a
    ``tl.debug_barrier()`` when other threads wrote the payload. Graph-safe. ``me`` is
    checked once, on every call.
    """
    check_index(me, SIZE, 0, -1, P_PUBLISH_AND_WAIT, MEMBER, False)
    if _DEBUG:
        _debug_publish(ptrs, cell, me)
    e = _publish(ptrs, cell, me, SIZE)
    return _wait(ptrs, cell, me, e, timeout_ns, SIZE)


@triton.jit
def wait_or_trap(ptrs, cell, me, epoch, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """:func:`wait` for ``epoch``; on a timeout or an abort write ``record`` and, if
    ``TRAP``, :func:`trap`.

    Returns the wait status (0: arrived, 1: timed out, 2: a member aborted). With
    ``TRAP`` (the GPU default) a failed kernel never returns, so nothing downstream on
    the stream runs on stale data; the record is written before the trap, because the
    CUDA context is unusable after it. ``me`` is checked on every call; a bad one is
    recorded in ``record`` (an index record) before the report.
    """
    check_index(me, SIZE, record, -1, P_WAIT_OR_TRAP, MEMBER, True)
    return _wait_or_trap(ptrs, cell, me, epoch, timeout_ns, record, SIZE, TRAP)


@triton.jit
def _wait_or_trap(ptrs, cell, me, epoch, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    # wait_or_trap() after its check (grid_fence and grid_sync check first themselves).
    status = _wait(ptrs, cell, me, epoch, timeout_ns, SIZE)
    if status != 0:
        write_timeout_record(record, ptrs, cell, me, epoch, SIZE)
        if TRAP:
            _prims.trap()
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
        n, e = arrive(&mem[me].cell.arrivals, num_programs - 1, RESET)
                                   # block barrier, e = epoch + 1 read before arriving,
                                   # acq_rel GPU add; the last one in publishes
        if n == num_programs - 1:                          # last one in
            wait_or_trap(e)

    Why it is correct: :func:`symmsync.language.core.arrive` (the one arrival counter of
    symmsync, shared with :func:`grid_sync` and the collectives) releases each program's
    writes on the counter, and its last program publishes after acquiring them all, so a
    member that observes its slot at ``e`` observes every program's writes; the arrivals
    need only GPU scope (its docstring says why, and what system scope would cost). Each
    program reads the epoch before it arrives, and only the last advances it, after
    acquiring every arrival, so the last one's ``e`` is the epoch before the launch plus
    one, the epoch its publish stores. A view of one member has nobody to tell: its
    kernels after this launch see its writes by stream order, so the tail only advances
    the epoch (as a fence of one member's does), at no cost. (The Spin model in
    ``verify/`` covers single-program fences, not this multi-program arrival.)
    Graph-safe. Cost: one GPU-scope atomic per program, one publish and one wait in
    total (with one member: one load and store). Returns the wait status (last program)
    or 0.
    """
    check_index(me, SIZE, record, -1, P_GRID_FENCE, MEMBER, True)
    ep = epoch_ptr(ptrs, cell, me)
    status = tl.full((), 0, tl.int32)  # not from ``me``: a launch may pass it as the constant 1
    if SIZE == 1:
        # A view of one member: nobody to publish to or wait for, and stream order shows
        # this launch's writes to the kernels after it. The epoch advances as in any fence.
        if tl.program_id(0) + tl.program_id(1) + tl.program_id(2) == 0:
            tl.store(ep, tl.load(ep) + 1)
    else:
        counter = (tl.load(ptrs + me) + cell + ARRIVALS).to(tl.pointer_type(tl.int64))
        last = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) - 1
        n, e = arrive(counter, ep, last, ptrs, cell, me, SIZE, True)  # e: read before arriving
        if n == last:
            status = _wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)
    return status


@triton.jit
def grid_sync(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """A whole fence in which every program of a multi-program kernel waits: afterwards every
    program may read what the members wrote before their own ``grid_sync``, in the same launch.

    Every program calls it, after its last write to peer memory. The last program to arrive
    publishes the next epoch; every program then waits for the members' publish of it.

    Pseudocode::

        n, e = arrive(&mem[me].cell.arrivals, num_programs - 1, RESET)
                                   # e = epoch + 1 read before arriving: see below;
                                   # the last one in publishes e
        return wait_or_trap(e)                             # every program

    Why it is correct: each program reads the epoch before its arrival (a release), and the
    last program advances it only after acquiring every arrival, so every program reads the
    epoch of before the launch and waits for the same ``e``. The publish is released after
    every program's writes (as in :func:`grid_fence`, whose arrivals also need only GPU
    scope), and each program's acquire of the members' slots at ``e`` makes their writes
    before their ``grid_sync`` visible to it.
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
    check_index(me, SIZE, record, -1, P_GRID_SYNC, MEMBER, True)
    counter = (tl.load(ptrs + me) + cell + ARRIVALS).to(tl.pointer_type(tl.int64))
    last = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) - 1
    _n, e = arrive(counter, epoch_ptr(ptrs, cell, me), last, ptrs, cell, me, SIZE, True)  # e: see above
    return _wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)


# ---------------------------------------------------------------------- debug checks
_STAMP_SHIFT = tl.constexpr(24)  # a debug stamp: launch number above, program index below
_STAMP_PROGRAM = tl.constexpr((1 << 24) - 1)


@triton.jit
def _debug_publish(ptrs, cell, me):
    # Slot ``me`` of this rank's own cell is a word no protocol uses (a rank never publishes
    # to itself): debug mode keeps there the launch and the program of the last publish. A
    # publish by another program of the same launch is the misuse; the same program
    # publishing again (or in a replay of the same graph node) is not.
    mine = (tl.load(ptrs + me) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
    pid = program_index().to(tl.int64)
    stamp = ((_prims.launch_id() + 1) << _STAMP_SHIFT) | pid
    old = tl.atomic_xchg(mine, stamp, sem="relaxed", scope="gpu")
    bad = ((old >> _STAMP_SHIFT) == (stamp >> _STAMP_SHIFT)) & ((old & _STAMP_PROGRAM) != pid)
    _prims.debug_fail(bad, 0, me, cell)
