"""The failure records: what a failed wait or a refused call leaves for the host, in one place.

A kernel that gives up (a wait whose budget ran out or that saw a member's abort, a
collective whose members' calls differ or whose programs were not all resident) writes a
record of int64 words into memory the host reads (pinned host memory on GPUs, read after
the trap), then traps on GPUs. Three records, each laid out below with a name for every
word, written by one device writer and read back by one host reader:

Fence record (:func:`write_timeout_record`; :func:`read_fence_record`, used by
:class:`~symmsync.Fence`)::

    [flag, epoch, index, size, slot[0], ..., slot[size - 1], aborter, reason[REASON_WORDS]]
      flag      TIMED_OUT, or ABORTED when a member below the epoch carries its abort flag
      epoch     the epoch waited for;  index: the waiting member's index;  size: the view's
      slot[j]   member j's raw slot (count | ABORT_FLAG); the waiter's own holds its own epoch
                counter when the wait gave up (below the epoch: this rank never published it)
      aborter   the first aborted member below the epoch, or -1;  reason: its reason words

Signal record (:func:`write_signal_record`; :func:`read_signal_record`, used by
:class:`~symmsync.Signals`)::

    [flag, index, peer, slot, cmp, counted, value, base, observed, aborter, reason[REASON_WORDS]]
      flag      TIMED_OUT, or ABORTED when a member of the view carries its abort flag
      counted   1 for wait_count (``value`` more signals beyond ``base``), 0 for wait_signal
                (``slot CMP value``; ``base`` is 0);  observed: the slot when the wait gave up

Collective record (:func:`write_grid_stall_record`; :func:`read_collective_record`, used by
:mod:`symmsync.collectives.mismatch`)::

    [flag, epoch, index, size, arrived]
      flag      GRID_STALL (a grid barrier ran out of time: ``arrived`` programs of the launch
                had arrived). Members whose calls differ are no record's: the call header's
                (:mod:`symmsync.language.calls`) check finds them, and the consumer's state keeps it.

Misuse record (:func:`write_misuse_record`; :func:`read_misuse_record`, used by
:class:`~symmsync.Fence` and :class:`~symmsync.Signals`): the first words of a fence or a
signal record, written instead of a wait's record when a primitive was misused::

    [flag, rank, primitive, program, which, value, bound]
      flag       INDEX: an index out of range (checked on every call: see check_index);
                 REFUSED: a signal or put_signal through a closed or aborted handle, which
                 stored nothing
      rank       the rank whose kernel made the call (a Signals handle's), or -1 (a fence
                 primitive: the host fills in its own)
      primitive  which primitive (an index into PRIMITIVES);  program: the program's linear index
      which      INDEX: 0 a peer, 1 a slot, 2 a member index (INDEX_NAMES);  REFUSED: the
                 handle's state (cells.REASON_CLOSED or REASON_ERROR)
      value      the index passed (REFUSED: the peer);  bound: the index had to be in [0, bound)

Every writer ends with :func:`finish_record`, in the order :func:`symmsync.language.record_barrier`
states: the words, a block barrier and a system fence, the flag word, a system fence and a
block barrier, then the trap. A host that sees the flag sees every other word, and no
thread traps before the flag is out. Plain stores, no atomics: a GPU atomic on pinned host
memory needs PCIe atomics, which a machine may lack.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..errors import ClosedError, IndexCheckError, SymmSyncError
from . import cells
from .core import (
    _CLOSED_EPOCH,
    _REASON_LANES,
    _REASON_WORDS,
    FIRST_BEHIND,
    FIRST_FLAGGED,
    REASON,
    _prims,
    epoch_ptr,
    program_index,
    scan_members,
    slots_ptr,
)

#: Flags (word 0) of the fence and signal records: a wait timed out ("SYMMTIME"); a wait
#: saw a member's abort ("SYMMABRT").
TIMED_OUT = 0x5359_4D4D_5449_4D45
ABORTED = 0x5359_4D4D_4142_5254
#: The flag of the collective record: the programs of one launch were not all resident at once
#: and a grid barrier ran out of time ("SYMMGRID").
GRID_STALL = 0x5359_4D4D_4752_4944

# ---------------------------------------------------------------------- the fence record
#: Word indices of the fence record's header; the slots start at FENCE_SLOTS.
FENCE_FLAG, FENCE_EPOCH, FENCE_INDEX, FENCE_SIZE, FENCE_SLOTS = 0, 1, 2, 3, 4


def fence_aborter(size: int) -> int:
    """Word index of a fence record's aborter (the first aborted member's index, or -1)."""
    return FENCE_SLOTS + size


def fence_reason(size: int) -> int:
    """Word index of the first reason word of a fence record."""
    return FENCE_SLOTS + size + 1


def fence_record_words(size: int) -> int:
    """int64 words of the fence record of a view of ``size`` members."""
    return fence_reason(size) + cells.REASON_WORDS


# ---------------------------------------------------------------------- the signal record
#: Word indices of a signal wait's record.
SIGNAL_FLAG, SIGNAL_INDEX, SIGNAL_PEER, SIGNAL_SLOT, SIGNAL_CMP, SIGNAL_COUNTED = 0, 1, 2, 3, 4, 5
SIGNAL_VALUE, SIGNAL_BASE, SIGNAL_OBSERVED, SIGNAL_ABORTER, SIGNAL_REASON = 6, 7, 8, 9, 10
SIGNAL_RECORD_WORDS = SIGNAL_REASON + cells.REASON_WORDS

# ---------------------------------------------------------------------- the misuse record
#: Flags of the misuse record: an index out of range ("SYMMINDX"); a signal through a
#: closed or aborted handle, refused ("SYMMSHUT").
INDEX = 0x5359_4D4D_494E_4458
REFUSED = 0x5359_4D4D_5348_5554
#: Word indices of the misuse record (the first words of a fence or a signal record).
MISUSE_FLAG, MISUSE_RANK, MISUSE_PRIMITIVE, MISUSE_PROGRAM, MISUSE_WHICH, MISUSE_VALUE, MISUSE_BOUND = range(7)
MISUSE_RECORD_WORDS = 7
#: The primitives a misuse record names (``primitive``), and the indices they check (``which``).
PRIMITIVES, INDEX_NAMES = cells.PRIMITIVES, cells.INDEX_NAMES
#: The kernels' names for them (``PRIMITIVE`` and ``WHICH`` of :func:`check_index`).
P_SIGNAL, P_WAIT_SIGNAL, P_WAIT_COUNT, P_READ_SIGNAL, P_PUT_SIGNAL, P_DATA_PTR = (tl.constexpr(i) for i in range(6))
P_PUBLISH, P_PENDING, P_WAIT, P_MARK_ABORT, P_PUBLISH_AND_WAIT = (tl.constexpr(i) for i in range(6, 11))
P_WAIT_OR_TRAP, P_GRID_FENCE, P_GRID_SYNC = (tl.constexpr(i) for i in range(11, 14))
PEER, SLOT, MEMBER = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

# ---------------------------------------------------------------------- the collective record
#: Word indices of the collective record.
COLL_FLAG, COLL_EPOCH, COLL_INDEX, COLL_SIZE, COLL_ARRIVED = 0, 1, 2, 3, 4
COLLECTIVE_RECORD_WORDS = 5


# ---------------------------------------------------------------------- the device writers
# The kernels' view of the same indices (compile-time constants). The fence record's
# aborter and reason sit at a fixed start plus the view size.
_TIMED_OUT = tl.constexpr(TIMED_OUT)
_ABORTED = tl.constexpr(ABORTED)
_FENCE_EPOCH = tl.constexpr(FENCE_EPOCH)
_FENCE_INDEX = tl.constexpr(FENCE_INDEX)
_FENCE_SIZE = tl.constexpr(FENCE_SIZE)
_FENCE_SLOTS = tl.constexpr(FENCE_SLOTS)
_FENCE_ABORTER = tl.constexpr(fence_aborter(0))  # + SIZE
_FENCE_REASON = tl.constexpr(fence_reason(0))  # + SIZE
_SIGNAL_INDEX = tl.constexpr(SIGNAL_INDEX)
_SIGNAL_PEER = tl.constexpr(SIGNAL_PEER)
_SIGNAL_SLOT = tl.constexpr(SIGNAL_SLOT)
_SIGNAL_CMP = tl.constexpr(SIGNAL_CMP)
_SIGNAL_COUNTED = tl.constexpr(SIGNAL_COUNTED)
_SIGNAL_VALUE = tl.constexpr(SIGNAL_VALUE)
_SIGNAL_BASE = tl.constexpr(SIGNAL_BASE)
_SIGNAL_OBSERVED = tl.constexpr(SIGNAL_OBSERVED)
_SIGNAL_ABORTER = tl.constexpr(SIGNAL_ABORTER)
_SIGNAL_REASON = tl.constexpr(SIGNAL_REASON)
_COLL_EPOCH = tl.constexpr(COLL_EPOCH)
_COLL_INDEX = tl.constexpr(COLL_INDEX)
_COLL_SIZE = tl.constexpr(COLL_SIZE)
_COLL_ARRIVED = tl.constexpr(COLL_ARRIVED)
_GRID_STALL = tl.constexpr(GRID_STALL)
_INDEX = tl.constexpr(INDEX)
_REFUSED = tl.constexpr(REFUSED)
_MISUSE_RANK = tl.constexpr(MISUSE_RANK)
_MISUSE_PRIMITIVE = tl.constexpr(MISUSE_PRIMITIVE)
_MISUSE_PROGRAM = tl.constexpr(MISUSE_PROGRAM)
_MISUSE_WHICH = tl.constexpr(MISUSE_WHICH)
_MISUSE_VALUE = tl.constexpr(MISUSE_VALUE)
_MISUSE_BOUND = tl.constexpr(MISUSE_BOUND)
assert FENCE_FLAG == SIGNAL_FLAG == COLL_FLAG == MISUSE_FLAG == 0, "finish_record writes the flag at word 0"
assert MISUSE_RECORD_WORDS <= min(SIGNAL_RECORD_WORDS, fence_record_words(1)), "a misuse record fits every record"
assert all(fence_aborter(n) - n == fence_aborter(0) and fence_reason(n) - n == fence_reason(0) for n in (1, 8, 64))


@triton.jit
def _words(record):
    """``record`` (a record's address, a kernel argument) as a pointer to its int64 words.
    Through int64 first: Triton 3.6's interpreter cannot turn a 32-bit integer into a
    pointer, and gives an argument whose value fits 32 bits that type."""
    return record.to(tl.int64).to(tl.pointer_type(tl.int64))


@triton.jit
def finish_record(rec, flag, TRAP: tl.constexpr):
    """Set a record's flag word (``rec``: an int64 pointer to word 0) last, then (``TRAP``) trap.

    Pseudocode::

        block_barrier(); record_barrier()     # every thread's words of the record first
        rec[0] = flag; record_barrier()       # the flag, performed before anything after it
        block_barrier(); if TRAP: trap()      # no thread traps before the flag is out

    The host (or, after a trap, a host reading pinned memory) that sees the flag sees the
    record's other words, and no thread traps before the flag has landed: a trap ends the
    kernel at once, and a write still in flight then never reaches the host.
    """
    tl.debug_barrier()
    _prims.memory_barrier_sys()
    tl.store(rec, flag)
    _prims.memory_barrier_sys()
    tl.debug_barrier()
    if TRAP:
        _prims.trap()


@triton.jit
def _copy_reason(dst, table, cell, first, me, SIZE: tl.constexpr):
    # The reason words of the first aborted member (``first``, SIZE for none; its cell at
    # ``table[first] + cell``) into ``dst``, zeros when there is none. Returns whether there
    # is one. The flag that named the member was seen by one thread's acquire load and the
    # reason is read by others: the block barrier and the system fence order those reads
    # after that load (cumulativity).
    tl.debug_barrier()
    _prims.memory_barrier_sys()
    w = tl.arange(0, _REASON_LANES)
    found = first < SIZE
    src = (tl.load(table + tl.where(found, first, me)) + cell + REASON).to(tl.pointer_type(tl.int64))
    words = _prims.load_acquire(src + tl.where(w < _REASON_WORDS, w, 0))
    tl.store(dst + w, tl.where(found, words, 0), mask=w < _REASON_WORDS)
    return found


@triton.jit
def write_timeout_record(record, ptrs, cell, me, epoch, SIZE: tl.constexpr):
    """Write what a failed fence wait saw to ``record`` (int64 words; the fence record above).

    ``flag`` is :data:`ABORTED` when a member below ``epoch`` carries the abort flag (then
    ``aborter`` is the first such member's index and ``reason`` the words of its own cell's
    reason, read through the pointer table), else :data:`TIMED_OUT` (``aborter`` is -1).
    Slots are raw: count and flag; this rank's own holds its own epoch counter, so that a
    reader can tell a wait that gave up on members from one whose own launch never published
    the epoch it waits for. The flag goes last (:func:`finish_record`, no trap:
    :func:`~symmsync.language.wait_or_trap` traps after it). The host turns the record into a
    :class:`~symmsync.FenceTimeout` (or :class:`~symmsync.PeerAborted`) that names the
    late or aborted members. A wait for an epoch at or past ``CLOSED_EPOCH`` (through
    arguments kept past ``close()``) names this rank itself as the aborter, with its own
    cell's reason ("closed").
    """
    rec = _words(record)
    first, _unused = scan_members(slots_ptr(ptrs, cell, me), me, epoch, rec + _FENCE_SLOTS, SIZE, FIRST_BEHIND)
    tl.store(rec + _FENCE_SLOTS + me, tl.load(epoch_ptr(ptrs, cell, me)))  # this rank's own count
    first = tl.where(tl.full((), 0, tl.int64) + epoch >= _CLOSED_EPOCH, me, first)  # int64: see _wait
    found = _copy_reason(rec + _FENCE_REASON + SIZE, ptrs, cell, first, me, SIZE)
    tl.store(rec + _FENCE_ABORTER + SIZE, tl.where(found, first, -1))
    tl.store(rec + _FENCE_EPOCH, epoch)
    tl.store(rec + _FENCE_INDEX, me)
    tl.store(rec + _FENCE_SIZE, SIZE)
    finish_record(rec, tl.where(found, _ABORTED, _TIMED_OUT), False)


@triton.jit
def write_signal_record(
    record,
    cell_table,
    me,
    peer,
    slot,
    value,
    base,
    observed,
    state,
    CMP: tl.constexpr,
    COUNTED: tl.constexpr,
    SIZE: tl.constexpr,
    TRAP: tl.constexpr,
):
    """Write what a failed signal wait saw to ``record`` (the signal record above), then trap with ``TRAP``.

    ``cell_table`` points at the view's table of channel-0 cell addresses in the handle
    (``cell[p]``), where the members' abort flags and reasons are. ``state`` is the handle's
    state word: when it is not 0 (the wait ran through a closed or aborted handle) the record
    names this rank as the aborter, with its own cell's reason and ``state`` as the reason code.
    """
    rec = _words(record)
    own = slots_ptr(cell_table, 0, me)
    first, _unused = scan_members(own, me, 0, own, SIZE, FIRST_FLAGGED)
    first = tl.where(state != 0, me, first)
    found = _copy_reason(rec + _SIGNAL_REASON, cell_table, 0, first, me, SIZE)
    tl.store(rec + _SIGNAL_REASON, state, mask=state != 0)
    tl.store(rec + _SIGNAL_ABORTER, tl.where(found, first, -1))
    tl.store(rec + _SIGNAL_INDEX, me)
    tl.store(rec + _SIGNAL_PEER, peer)
    tl.store(rec + _SIGNAL_SLOT, slot)
    tl.store(rec + _SIGNAL_CMP, CMP)
    tl.store(rec + _SIGNAL_COUNTED, COUNTED)
    tl.store(rec + _SIGNAL_VALUE, value)
    tl.store(rec + _SIGNAL_BASE, base)
    tl.store(rec + _SIGNAL_OBSERVED, observed)
    finish_record(rec, tl.where(found, _ABORTED, _TIMED_OUT), TRAP)


@triton.jit
def write_misuse_record(record, flag, rank, PRIMITIVE: tl.constexpr, which, value, bound):
    """Write a misuse record (``flag``: :data:`INDEX` or :data:`REFUSED`; the layout above) to ``record``."""
    rec = _words(record)
    pid = program_index()
    tl.store(rec + _MISUSE_RANK, rank)
    tl.store(rec + _MISUSE_PRIMITIVE, PRIMITIVE)
    tl.store(rec + _MISUSE_PROGRAM, pid)
    tl.store(rec + _MISUSE_WHICH, which)
    tl.store(rec + _MISUSE_VALUE, value)
    tl.store(rec + _MISUSE_BOUND, bound)
    finish_record(rec, flag, False)


@triton.jit(noinline=True)  # the cold path stays out of line: nothing of it is hoisted into the hot one
def report_index(record, rank, PRIMITIVE: tl.constexpr, which, value, bound, RECORDED: tl.constexpr):
    """Report an index out of range; never returns (the cold path of :func:`check_index`).

    With ``RECORDED``, write an :data:`INDEX` misuse record at ``record`` first; then the
    per-mode report: the interpreter raises :class:`~symmsync.IndexCheckError`, a GPU kernel
    prints the rank, program, primitive, which index, value and bound, and traps.
    """
    if RECORDED:
        write_misuse_record(record, _INDEX, rank, PRIMITIVE, which, value, bound)
    _prims.index_fail(rank, PRIMITIVE, which, value, bound)


@triton.jit
def check_index(index, bound, record, rank, PRIMITIVE: tl.constexpr, WHICH: tl.constexpr, RECORDED: tl.constexpr):
    """Refuse ``index`` outside ``[0, bound)``: the check every fence primitive makes on every call
    (the signal primitives check their three indices at once, the same way).

    Pseudocode::

        if index < 0 or index >= bound:                   # the hot path: two compares, a branch
            if RECORDED: write an INDEX misuse record at record (rank, program, index, bound)
            index_fail(...)       # interpreter: raise IndexCheckError; GPU: printf, then trap

    The report never returns (the interpreter raises, a GPU kernel traps), so nothing after
    the check runs with the bad index: no member's word is read or written through it.
    ``RECORDED`` is False for primitives that take no record (the fence's publish, pending,
    wait, mark_abort, publish_and_wait): they report by the print and the trap (GPU) or the
    raise (interpreter) alone.
    """
    if (index < 0) | (index >= bound):
        report_index(record, rank, PRIMITIVE, WHICH, index, bound, RECORDED)


@triton.jit
def write_grid_stall_record(record, me, epoch, arrived, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """Write a ``GRID_STALL`` collective record (``arrived`` programs had arrived), then trap with ``TRAP``."""
    rec = _words(record)
    tl.store(rec + _COLL_EPOCH, epoch)
    tl.store(rec + _COLL_INDEX, me)
    tl.store(rec + _COLL_SIZE, SIZE)
    tl.store(rec + _COLL_ARRIVED, arrived)
    finish_record(rec, _GRID_STALL, TRAP)


# ---------------------------------------------------------------------- the host readers
@dataclass
class FenceRecord:
    """A failed fence wait's record, read back (see the layout above)."""

    aborted: bool  #: a member's abort flag was seen (else: the budget ran out)
    epoch: int  #: the epoch waited for
    index: int  #: the waiting member's index in the view
    slots: list[int]  #: raw slots: count | ABORT_FLAG
    aborter: int  #: index of the first aborted member below the epoch, or -1
    reason: list[int]  #: that member's reason words


def read_fence_record(words: list[int]) -> FenceRecord | None:
    """The fence record in ``words``, or ``None`` when no wait failed."""
    if words[FENCE_FLAG] not in (TIMED_OUT, ABORTED):
        return None
    size = words[FENCE_SIZE]
    return FenceRecord(
        aborted=words[FENCE_FLAG] == ABORTED,
        epoch=words[FENCE_EPOCH],
        index=words[FENCE_INDEX],
        slots=words[FENCE_SLOTS : FENCE_SLOTS + size],
        aborter=words[fence_aborter(size)],
        reason=words[fence_reason(size) : fence_reason(size) + cells.REASON_WORDS],
    )


@dataclass
class SignalRecord:
    """A failed signal wait's record, read back (see the layout above)."""

    aborted: bool  #: a member's abort flag was seen (else: the budget ran out)
    index: int  #: the waiting member's index in the view
    peer: int  #: the index of the member whose slot it waited on
    slot: int  #: the slot
    cmp: int  #: the comparison (an index into cells.CMP_NAMES)
    counted: bool  #: a wait_count (value signals beyond base) rather than an absolute wait
    value: int  #: the value (or count) awaited
    base: int  #: what earlier counted waits had consumed (counted waits)
    observed: int  #: the slot's value when the wait gave up
    aborter: int  #: the index of the first member whose abort flag was seen, or -1
    reason: list[int]  #: that member's reason words


def read_signal_record(words: list[int]) -> SignalRecord | None:
    """The signal record in ``words``, or ``None`` when no wait failed."""
    if words[SIGNAL_FLAG] not in (TIMED_OUT, ABORTED):
        return None
    return SignalRecord(
        aborted=words[SIGNAL_FLAG] == ABORTED,
        index=words[SIGNAL_INDEX],
        peer=words[SIGNAL_PEER],
        slot=words[SIGNAL_SLOT],
        cmp=words[SIGNAL_CMP],
        counted=bool(words[SIGNAL_COUNTED]),
        value=words[SIGNAL_VALUE],
        base=words[SIGNAL_BASE],
        observed=words[SIGNAL_OBSERVED],
        aborter=words[SIGNAL_ABORTER],
        reason=words[SIGNAL_REASON : SIGNAL_REASON + cells.REASON_WORDS],
    )


@dataclass
class MisuseRecord:
    """A misuse record, read back (see the layout above)."""

    refused: bool  #: a signal through a closed or aborted handle (else: an index out of range)
    rank: int  #: the rank whose kernel made the call, or -1 (a fence primitive)
    primitive: str  #: the primitive's name
    program: int  #: the program's linear index
    which: str  #: INDEX: "peer", "slot" or "member";  REFUSED: "closed" or "aborted"
    value: int  #: the index passed (REFUSED: the peer)
    bound: int  #: the index had to be in [0, bound)


def read_misuse_record(words: list[int]) -> MisuseRecord | None:
    """The misuse record in ``words`` (a fence's or a signal record's), or ``None`` when there is none."""
    if words[MISUSE_FLAG] not in (INDEX, REFUSED):
        return None
    refused = words[MISUSE_FLAG] == REFUSED
    which = words[MISUSE_WHICH]
    if refused:
        name = "closed" if which == cells.REASON_CLOSED else "aborted"
    else:
        name = INDEX_NAMES[which] if 0 <= which < len(INDEX_NAMES) else f"index kind {which}"
    primitive = words[MISUSE_PRIMITIVE]
    return MisuseRecord(
        refused=refused,
        rank=words[MISUSE_RANK],
        primitive=PRIMITIVES[primitive] if 0 <= primitive < len(PRIMITIVES) else f"primitive {primitive}",
        program=words[MISUSE_PROGRAM],
        which=name,
        value=words[MISUSE_VALUE],
        bound=words[MISUSE_BOUND],
    )


def misuse_error(rec: MisuseRecord, rank: int, what: str) -> SymmSyncError:
    """The error a misuse record describes (:func:`symmsync.language.records.read_misuse_record`), for
    the host reader of a Signals object or a fence (``what``) on rank ``rank``: an
    :class:`~symmsync.IndexCheckError`, or a :class:`~symmsync.ClosedError` for a signal
    refused through a closed or aborted handle."""
    who = rec.rank if rec.rank >= 0 else rank
    if rec.refused:
        return ClosedError(
            f"rank {who}, program {rec.program}: {rec.primitive} to peer index {rec.value} through {what} kernel "
            f"arguments kept past the object being {rec.which}: nothing was stored (a closed handle never makes a "
            "peer's wait pass). Take kernel_args from a live object"
        )
    return IndexCheckError(
        IndexCheckError.describe(who, rec.primitive, rec.program, rec.which, rec.value, rec.bound),
        rank=who,
        primitive=rec.primitive,
        which=rec.which,
        value=rec.value,
        bound=rec.bound,
    )


@dataclass
class CollectiveRecord:
    """A collective's record, read back (see the layout above): a grid barrier that stalled."""

    epoch: int  #: the fence epoch of the call
    index: int  #: the writing member's index in the view
    arrived: int  #: programs of the launch that had arrived


def read_collective_record(words: list[int]) -> CollectiveRecord | None:
    """The collective record in ``words``, or ``None`` when no launch stalled."""
    if words[COLL_FLAG] != GRID_STALL:
        return None
    return CollectiveRecord(epoch=words[COLL_EPOCH], index=words[COLL_INDEX], arrived=words[COLL_ARRIVED])
