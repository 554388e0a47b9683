"""The grid-wide wait, the point-to-point signal primitives and the debug checks of :mod:`symmsync.language`.

Kernels call them as ``symmsync.language.signal``, ``wait_signal``, ... : this module
holds their source, :mod:`symmsync.language` exports them and states their contract
(its ``signals-contract`` block); the handle they take is laid out in
:mod:`symmsync.cells`. Import :mod:`symmsync.language`, not this module.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import cells
from .language import (  # defined before symmsync.language imports this module
    _DEBUG,
    _REASON_LANES,
    _REASON_WORDS,
    ABORTED,
    ARRIVALS,
    LANES,
    REASON,
    SLOTS,
    TIMED_OUT,
    _prims,
    _publish,
    epoch_ptr,
    trap,
    wait_or_trap,
)


# ---------------------------------------------------------------------- the grid-wide wait
@triton.jit
def grid_sync(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """A whole fence in which every program of a multi-program kernel waits: afterwards every
    program may read what the members wrote before their own ``grid_sync``, in the same launch.

    Every program calls it, after its last write to peer memory. The last program to arrive
    publishes the next epoch; every program then waits for the members' publish of it.

    Pseudocode::

        block_barrier()                                    # this program's writes first
        e = mem[me].cell.epoch + 1                         # read before arriving: see below
        n = atomic_add_acq_rel_gpu(&mem[me].cell.arrivals, 1)
        if n == num_programs - 1:                          # last one in
            mem[me].cell.arrivals = 0
            publish()                                      # advances the epoch to e
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
    tl.debug_barrier()
    e = tl.load(epoch_ptr(ptrs, cell, me)) + 1
    counter = (tl.load(ptrs + me) + cell + ARRIVALS).to(tl.pointer_type(tl.int64))
    nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    n = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
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
