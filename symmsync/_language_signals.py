"""The point-to-point signal primitives of :mod:`symmsync.language` and their debug checks.

Kernels call them as ``symmsync.language.signal``, ``wait_signal``, ... : this module
holds their source, :mod:`symmsync.language` exports them and states their contract
(its ``signals-contract`` block); the handle they take is laid out in
:mod:`symmsync.cells`, the record a failed wait writes in :mod:`symmsync.records`, and the
bounded poll they wait with is :mod:`symmsync._language_core`'s. Import
:mod:`symmsync.language`, not this module.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import cells
from ._language_core import (
    _DEBUG,
    GE,
    VALUE,
    _prims,
    bounded_poll,
)
from .records import write_signal_record


# ---------------------------------------------------------------------- debug checks
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
#: The comparisons of :func:`wait_signal` (``CMP``: EQ NE GE GT LE LT) are the core's,
#: exported by :mod:`symmsync.language`.

_HANDLE_NBYTES = tl.constexpr(cells.HANDLE_NBYTES)
_HANDLE_RANK = tl.constexpr(cells.HANDLE_RANK)
_HANDLE_SIZE = tl.constexpr(cells.HANDLE_SIZE)
_HANDLE_BASES = tl.constexpr(cells.HANDLE_BASES)
_HANDLE_INBOX = tl.constexpr(cells.HANDLE_INBOX)
_HANDLE_CELLS = tl.constexpr(cells.HANDLE_INBOX)  # + 2 * SIZE: the table of the members' cells
assert cells.handle_data(7) == cells.HANDLE_INBOX + 7
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
def _wait_until(src, target, CMP: tl.constexpr, sig, me, timeout_ns, SIZE: tl.constexpr):
    # (status, the value last observed): the bounded poll on one slot, with the abort flags
    # of the view's channel-0 cell (the handle's cell table) read after a failed first poll.
    return bounded_poll(src, target, sig + _HANDLE_CELLS + 2 * SIZE, 0, me, timeout_ns, SIZE, VALUE, CMP)


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
        write_signal_record(record, sig + _HANDLE_CELLS + 2 * SIZE, me, peer, slot, value, v * 0, v, CMP, 0, SIZE, TRAP)
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
        write_signal_record(record, sig + _HANDLE_CELLS + 2 * SIZE, me, peer, slot, count, b, v, GE, 1, SIZE, TRAP)
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
