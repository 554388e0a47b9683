"""The point-to-point signal primitives of :mod:`symmsync.language` and their debug checks.

Kernels call them as ``symmsync.language.signal``, ``wait_signal``, ... : this module
holds their source, :mod:`symmsync.language` exports them and states their contract
(its ``signals-contract`` block); the handle they take is laid out in
:mod:`symmsync.language.cells`, the record a failed wait writes in :mod:`symmsync.language.records`, and the
bounded poll they wait with is :mod:`symmsync.language.core`'s. Import
:mod:`symmsync.language`, not this module.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import cells
from .core import _DEBUG, GE, VALUE, _prims, bounded_poll
from .records import (
    _REFUSED,
    MEMBER,
    P_DATA_PTR,
    P_PUT_SIGNAL,
    P_READ_SIGNAL,
    P_SIGNAL,
    P_WAIT_COUNT,
    P_WAIT_SIGNAL,
    PEER,
    SLOT,
    report_index,
    write_misuse_record,
    write_signal_record,
)

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
_HANDLE_RECORD = tl.constexpr(cells.HANDLE_RECORD)
_HANDLE_STATE = tl.constexpr(cells.HANDLE_STATE)
_HANDLE_INBOX = tl.constexpr(cells.HANDLE_INBOX)
_HANDLE_CELLS = tl.constexpr(cells.HANDLE_INBOX)  # + 2 * SIZE: the table of the members' cells
_LINE = tl.constexpr(cells.LINE)
assert cells.handle_data(7) == cells.HANDLE_INBOX + 7
assert cells.handle_cell(7) == cells.HANDLE_INBOX + 14


# ---------------------------------------------------------------------- checks
@triton.jit
def _check_target(sig, me, peer, slot, size, NSLOTS: tl.constexpr, PRIMITIVE: tl.constexpr):
    # The indices a primitive addresses a slot with, on every call, with one cold path: a bad
    # one is recorded at the handle's record and reported (never returns), so nothing is read
    # or written through it. The first bad one is reported: me, then peer, then slot.
    bad_me = (me < 0) | (me >= size)
    bad_peer = (peer < 0) | (peer >= size)
    bad_slot = (slot < 0) | (slot >= NSLOTS)
    if bad_me | bad_peer | bad_slot:
        which = tl.where(bad_me, MEMBER, tl.where(bad_peer, PEER, SLOT))
        value = tl.where(bad_me, me, tl.where(bad_peer, peer, slot))
        bound = tl.where(bad_me | bad_peer, size, NSLOTS)
        rank = tl.load(sig + _HANDLE_RANK)
        report_index(tl.load(sig + _HANDLE_RECORD), rank, PRIMITIVE, which, value, bound, True)


@triton.jit
def _refuse(sig, peer, state, PRIMITIVE: tl.constexpr):
    # A signal through a closed or aborted handle: nothing was stored; say so in the record.
    rank = tl.load(sig + _HANDLE_RANK)
    write_misuse_record(tl.load(sig + _HANDLE_RECORD), _REFUSED, rank, PRIMITIVE, state, peer, 0)


@triton.jit
def _debug_offsets(sig, offset, mask, ELEM: tl.constexpr):
    # Debug mode: every live lane's bytes [offset, offset + ELEM) must lie in the user region.
    # (Masks are combined as ints: the interpreter mishandles a boolean block broadcast with a scalar.)
    nbytes = tl.load(sig + _HANDLE_NBYTES)
    off = offset + tl.zeros([1], tl.int64)
    live = (mask + tl.zeros([1], tl.int32)) != 0
    bad = ((off < 0) | (off + ELEM > nbytes)).to(tl.int32) * live.to(tl.int32)
    worst = tl.max(tl.where(bad != 0, off, -(2**62)), axis=None)
    _prims.debug_fail(tl.max(bad, axis=None) > 0, 1, tl.load(sig + _HANDLE_RANK), worst)


@triton.jit
def _kind_ptr(sig, owner, sender, slot, size, NSLOTS: tl.constexpr):
    # Debug mode: kind[sender][slot] in member ``owner``'s signal memory (the third array).
    inbox = ((size * NSLOTS * 8 + _LINE - 1) // _LINE) * _LINE
    return (tl.load(sig + _HANDLE_INBOX + owner) + 2 * inbox + (sender * NSLOTS + slot) * 8).to(
        tl.pointer_type(tl.int64)
    )


@triton.jit
def _debug_mark_set(sig, me, peer, slot, size, NSLOTS: tl.constexpr):
    # Debug mode, a SET: mark the slot at the peer before the release that carries the value,
    # so a counted wait that observes the value observes the mark too.
    tl.store(_kind_ptr(sig, peer, me, slot, size, NSLOTS), 1)


@triton.jit
def _debug_counted_on_set(sig, me, peer, slot, SIZE: tl.constexpr, NSLOTS: tl.constexpr):
    # Debug mode, after a counted wait's poll (acquire): a SET that it observed is marked.
    kind = tl.load(_kind_ptr(sig, me, peer, slot, SIZE, NSLOTS))
    _prims.debug_fail(kind != 0, 2, tl.load(sig + _HANDLE_RANK), slot)


@triton.jit
def _slot_ptr(sig, owner, sender, slot, NSLOTS: tl.constexpr):
    # inbox[sender][slot] in member ``owner``'s signal memory
    return (tl.load(sig + _HANDLE_INBOX + owner) + (sender * NSLOTS + slot) * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def _base_ptr(sig, peer, slot, NSLOTS: tl.constexpr):
    # base[peer][slot] in this member's own signal memory
    return (tl.load(sig + _HANDLE_BASES) + (peer * NSLOTS + slot) * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def _send(sig, me, peer, slot, value, size, OP: tl.constexpr, NSLOTS: tl.constexpr):
    # The signal itself (thread 0, release): signal()'s and put_signal()'s.
    if _DEBUG:
        if OP == SET:
            _debug_mark_set(sig, me, peer, slot, size, NSLOTS)
    dst = _slot_ptr(sig, peer, me, slot, NSLOTS)
    if OP == SET:
        _prims.signal_set(dst, value)
    else:
        _prims.signal_add(dst, value)


@triton.jit
def signal(sig, me, peer, slot, value, OP: tl.constexpr, NSLOTS: tl.constexpr):
    """Add ``value`` to (``ADD``), or store it in (``SET``), slot ``slot`` that this rank has at
    member ``peer``; released at system scope.

    Pseudocode::

        check 0 <= me, peer < size and 0 <= slot < NSLOTS  # else record, report (no return)
        if handle.state != 0: record REFUSED; return      # closed or aborted: store nothing
        dst = &mem[peer].inbox[me][slot]                   # int64
        if OP == ADD: red_add_release_sys(dst, value)      # thread 0 of the program
        else:         st_release_sys(dst, value)

    Contract: every write this rank made before the call (by this thread; by the block's
    other threads once they passed a ``tl.debug_barrier()``; by kernels earlier on the
    stream) is visible to ``peer`` once it observes the value this call produced (with
    :func:`wait_signal`, :func:`wait_count` or :func:`read_signal`: acquire loads). Exactly
    once per call for a program of any ``num_warps``. Use ``ADD`` for counters (replay
    safe with :func:`wait_count`), ``SET`` for flags and sequence numbers the kernel computes
    on the device (waited on with :func:`wait_signal`: docs/signals.md, "Slot kinds").
    Indices are checked on every call: a bad one raises
    :class:`~symmsync.IndexCheckError` (interpreter) or is recorded and traps (GPU), and
    nothing is stored. Through a handle whose Signals object closed, or whose view this rank
    aborted, nothing is stored either (the record says so), so such a member never makes a
    peer's wait pass. Graph-safe. Cost: one remote reduction (ADD) or store (SET), no reply
    awaited; four loads from the handle (cached) and the checks' compares
    (docs/signals.md, "What the checks cost").

    Args:
        sig: the handle (``Signals.kernel_args[0]``).
        me: this rank's index in the view (``Signals.kernel_args[1]``).
        peer: the member to signal (0..SIZE-1; itself too).
        slot: which of its slots (0..NSLOTS-1).
        value: int64 to add or store.
        OP: :data:`ADD` or :data:`SET`.
        NSLOTS: the object's slots per peer (``Signals.slots``).
    """
    size = tl.load(sig + _HANDLE_SIZE)
    _check_target(sig, me, peer, slot, size, NSLOTS, P_SIGNAL)
    state = tl.load(sig + _HANDLE_STATE)
    if state == 0:
        _send(sig, me, peer, slot, value, size, OP, NSLOTS)
    else:
        _refuse(sig, peer, state, P_SIGNAL)


@triton.jit
def read_signal(sig, me, peer, slot, NSLOTS: tl.constexpr):
    """The value of the slot ``peer`` signals this rank on (one acquire load at system scope).

    Pseudocode::

        check 0 <= me, peer < size and 0 <= slot < NSLOTS  # else record, report (no return)
        return load_acquire_sys(&mem[me].inbox[peer][slot])

    Reads after it see every write ``peer`` made before the signal that produced the value
    read. It is a read, not a wait: through a closed handle it still reads the slot (kept
    mapped). Graph-safe. Cost: three loads from the handle, the checks, one acquire load.
    """
    _check_target(sig, me, peer, slot, tl.load(sig + _HANDLE_SIZE), NSLOTS, P_READ_SIGNAL)
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

        check 0 <= me, peer < SIZE and 0 <= slot < NSLOTS  # else record, report (no return)
        if handle.state != 0: status = 2                   # closed or aborted: fail at once
        else loop:                                         # acquire loads, system scope
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
    ``TRAP``, the kernel never returns. Through the kept arguments of a Signals object that
    closed, or whose view this rank aborted, the wait returns 2 before it reads the slot,
    whatever the slot holds, and the record names this rank and why. The comparison is
    absolute: a slot that only grows
    (``ADD``) compared with ``GE`` against a value computed on the device (a device epoch,
    say) is replay safe; against a constant it is not (a second replay sees the first's
    counts): use :func:`wait_count` for counters. The budget and clock are :func:`wait`'s.
    Indices are checked as :func:`signal` checks them. Graph-safe. Cost: the checks, one
    load of the state word, one acquire load per poll; the flags and the clock only after a
    first poll that did not succeed.

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
    _check_target(sig, me, peer, slot, SIZE, NSLOTS, P_WAIT_SIGNAL)
    state = tl.load(sig + _HANDLE_STATE)
    if state == 0:
        status, v = _wait_until(_slot_ptr(sig, me, peer, slot, NSLOTS), value, CMP, sig, me, timeout_ns, SIZE)
    else:  # a closed or aborted handle: fail before reading the slot
        status = tl.full((), 2, tl.int32)  # ABORTED_STATUS
        v = tl.full((), 0, tl.int64)
    if status != 0:
        write_signal_record(
            record, sig + _HANDLE_CELLS + 2 * SIZE, me, peer, slot, value, v * 0, v, state, CMP, 0, SIZE, TRAP
        )
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

        check 0 <= me, peer < SIZE and 0 <= slot < NSLOTS  # else record, report (no return)
        b = mem[me].base[peer][slot]                      # device-resident, this rank's alone
        if handle.state != 0: status = 2                  # closed or aborted: fail at once
        else: status = wait until mem[me].inbox[peer][slot] >= b + count   (as wait_signal, GE)
        if status == 0: mem[me].base[peer][slot] = b + count
        else: record (counted: count, base b, the value observed); trap if TRAP

    Contract: as :func:`wait_signal` with ``GE`` against ``b + count``. Replay safe: the base
    lives in device memory and only this rank's counted waits advance it, so a kernel that
    signals ``k`` times and one that waits ``k`` times, each captured once in a CUDA graph,
    stay in step over any number of replays with no reset: a producer ahead of the consumer
    is harmless (it is ``>=``, never ``==``). For ``ADD`` slots only: debug mode refuses a
    slot a peer ``SET`` (docs/signals.md, "Slot kinds"). Call it from one program per
    (peer, slot) and launch. Graph-safe. Cost: one local load and store, then
    :func:`wait_signal`'s.
    """
    _check_target(sig, me, peer, slot, SIZE, NSLOTS, P_WAIT_COUNT)
    bp = _base_ptr(sig, peer, slot, NSLOTS)
    b = tl.load(bp)
    state = tl.load(sig + _HANDLE_STATE)
    if state == 0:
        status, v = _wait_until(_slot_ptr(sig, me, peer, slot, NSLOTS), b + count, GE, sig, me, timeout_ns, SIZE)
    else:  # a closed or aborted handle: fail before reading the slot
        status = tl.full((), 2, tl.int32)  # ABORTED_STATUS
        v = tl.full((), 0, tl.int64)
    if _DEBUG:
        _debug_counted_on_set(sig, me, peer, slot, SIZE, NSLOTS)
    # Every thread loaded the base before any stores the new one (a lagging warp would
    # otherwise read it advanced and wait for twice the count).
    tl.debug_barrier()
    tl.store(bp, tl.where(status == 0, b + count, b))
    if status != 0:
        write_signal_record(
            record, sig + _HANDLE_CELLS + 2 * SIZE, me, peer, slot, count, b, v, state, GE, 1, SIZE, TRAP
        )
    return status


@triton.jit
def data_ptr(sig, peer, offset, DTYPE: tl.constexpr):
    """Typed pointer to byte ``offset`` of member ``peer``'s user region, through a Signals handle.

    :func:`peer_ptr` for the table in the handle (the view's ``ptrs``), with ``peer``
    checked on every call (``0 <= peer < size``, else recorded and reported as
    :func:`signal` does): the checked form of :func:`peer_ptr`. ``offset`` may be a
    block (one byte offset per lane). In debug mode (:data:`DEBUG`) every lane's bytes must
    lie inside the view's user region, or the kernel reports the rank, the program and the
    offset (keep masked-off lanes' offsets in range, or use :func:`put_signal`, which checks
    only live lanes). Graph-safe. Cost: two loads from the handle (cached), the check, one add.
    """
    if _DEBUG:
        _debug_offsets(sig, offset, 1, DTYPE.primitive_bitwidth // 8)
    size = tl.load(sig + _HANDLE_SIZE)
    _check_target(sig, 0, peer, 0, size, 1, P_DATA_PTR)  # peer alone: me 0 and slot 0 of 1 check away
    return (tl.load(sig + _HANDLE_INBOX + size + peer) + offset).to(tl.pointer_type(DTYPE))


@triton.jit
def put_signal(sig, me, peer, offset, values, mask, slot, NSLOTS: tl.constexpr, value=1, OP: tl.constexpr = ADD):
    """Store a tile into ``peer``'s user region, then signal ``value`` (ADD, the default: add 1)
    on the slot this rank has there.

    Pseudocode::

        check 0 <= me, peer < size and 0 <= slot < NSLOTS  # else record, report (no return)
        if handle.state != 0: record REFUSED; return      # closed or aborted: store nothing
        store(mem[peer].data + offset, values, mask)       # every thread its lanes
        block_barrier()                                    # the whole tile before the release
        signal(peer, slot, value, OP)                      # thread 0: red.add or st, release

    Contract: ``peer`` sees the whole tile once it observes the value this call produced in
    the slot (its :func:`wait_count` of 1 returns 0 for an ``ADD`` of 1, its
    :func:`wait_signal` sees the value or count): the block barrier inside orders every
    thread's stores before thread 0's release, which is cumulative. ``value`` and ``OP``
    are :func:`signal`'s (as NVSHMEM's ``putmem_signal`` takes a value and ADD or SET); a
    ``SET`` slot is waited on with :func:`wait_signal` (docs/signals.md, "Slot kinds").
    ``offset`` is a block of byte offsets (one per lane, shaped like
    ``values``, multiples of the element size), ``mask`` which lanes store. Call it from a
    whole program (every thread reaches the barrier). A ring of tiles reused by the
    producer needs credits from the consumer (a signal back, as in the tutorial). Indices
    are checked on every call; in debug mode every live lane must lie inside the user
    region. Graph-safe. Cost: the stores, a block barrier, one remote reduction or store,
    the checks.
    """
    ELEM: tl.constexpr = values.dtype.primitive_bitwidth // 8
    if _DEBUG:
        _debug_offsets(sig, offset, mask, ELEM)
    size = tl.load(sig + _HANDLE_SIZE)
    _check_target(sig, me, peer, slot, size, NSLOTS, P_PUT_SIGNAL)
    state = tl.load(sig + _HANDLE_STATE)
    if state == 0:
        dst = (tl.load(sig + _HANDLE_INBOX + size + peer) + offset).to(tl.pointer_type(values.dtype))
        tl.store(dst, values, mask=mask)
        tl.debug_barrier()
        _send(sig, me, peer, slot, value, size, OP, NSLOTS)
    else:
        _refuse(sig, peer, state, P_PUT_SIGNAL)
