"""Device-side primitives for Triton kernels: peer addresses, publish, wait, fence.

Call these from your own ``@triton.jit`` kernels. They take a peer view's pointer
tables (``view.ptrs``, the members' user regions, and ``view.cell_ptrs``, their cells:
int64 base addresses in view order), the byte offset of a cell from the cell table
(``view.cell_offset(channel)``), this rank's index in the view (``view.local_index``)
and the view size as a compile-time constant (``SIZE``)::

    @triton.jit
    def exchange(data, cells, cell, me, value, timeout_ns, SIZE: tl.constexpr):
        for p in tl.static_range(SIZE):
            dst = ssl.peer_ptr(data, p, 0, tl.int64)
            tl.store(dst + me, value)            # payload into every peer
        tl.debug_barrier()                        # every thread's payload before the release
        e = ssl.publish(cells, cell, me, SIZE)
        status = ssl.wait(cells, cell, me, e, timeout_ns, SIZE)

A :class:`~symmsync.Fence` hands a kernel its fence arguments at once:
``fence.kernel_args`` is ``(cells, cell, me, timeout_ns, record)``.

The fence primitives (publish, wait, and everything built on them) take the table the
cells are offset from, ``view.cell_ptrs``, never ``view.ptrs``: for every kind of memory
the cells live in an allocation of their own, between guards, apart from the user
regions (so no store past a user region reaches a cell), and a kernel that writes
payload and fences takes both tables, as above.

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
    indices        every primitive that takes me checks 0 <= me < SIZE on every call: a bad
                   one is reported (IndexCheckError; recorded first where there is a record)
                   and never used as an address.
    closed         close() stores an epoch past any count (CLOSED_EPOCH): a wait for an epoch
                   at or past it (arguments kept past close) returns 2 before reading a slot.
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
    indices        every primitive checks me and peer (0..SIZE-1) and slot (0..NSLOTS-1) on
                   every call: a bad one is recorded and reported (IndexCheckError), never
                   used as an address.
    closed         through kernel_args kept past Signals.close(), the buffer's close() or
                   this rank's abort of the view, a wait returns 2 before reading its slot,
                   whatever the slot holds; signal and put_signal store nothing.
    kinds          a slot is a counter (ADD, wait_count) or a flag (SET, wait_signal), never
                   both (docs/signals.md, "Slot kinds"; debug mode refuses wait_count on SET).
    reuse          a signal orders visibility only: a ring of reused tiles needs credits.
    --8<-- [end:signals-contract]

:func:`data_ptr` is :func:`peer_ptr` through the handle, with the peer checked (debug mode
also checks the user region); :func:`peer_ptr` and :func:`translate` are unchecked.
Peer atomics are Triton's own on a :func:`peer_ptr` (``tl.atomic_add(ptr, v, sem=...,
scope="sys")``): pass ``scope="sys"`` for a peer's memory (docs/signals.md lists each and
its order).

:func:`grid_sync` is a fence in which every program of a co-resident grid waits
(:func:`symmsync.launch_grid_sync` checks the grid). Indices (``me``, ``peer``, ``slot``) are
checked on every call. With ``SYMMSYNC_DEBUG=1`` (:data:`DEBUG`) the kernels also check
that one program per launch publishes on a channel, that the offsets of :func:`data_ptr` and
:func:`put_signal` lie inside the user region, and that :func:`wait_count` is not used on a
slot a peer SET.

A cell is the same byte offset ``cell`` in every member's memory; its layout (epoch,
arrivals, abort reason, slots) is :mod:`symmsync.language.cells`'s, exported here as constants
(:data:`EPOCH`, :data:`ARRIVALS`, :data:`REASON`, :data:`SLOTS`, ...); the records a failed
wait writes (:func:`write_timeout_record`, the signals' record) are :mod:`symmsync.language.records`'.

Where the source lives. This module is the face kernels import; it defines nothing but
the constants above. Each protocol step has one implementation behind it:
:mod:`symmsync.language.core` holds what every kernel of symmsync shares (the arrival
counter ``arrive``, the bounded poll ``bounded_poll``, the scan of the members' slots
``scan_members``, :func:`record_barrier`, :func:`clock_ns`, :func:`trap`);
:mod:`symmsync.language.fence` the fence (:func:`publish`, :func:`wait`,
:func:`mark_abort`, :func:`grid_fence`, :func:`grid_sync`, ...);
:mod:`symmsync.language.signals` the point-to-point signals; :mod:`symmsync.language.records` the
records' writers; :mod:`symmsync.language.bf16` and :mod:`symmsync.language.e4m3` the exact number
conversions the consumers' kernels share (bfloat16 bits to and from float32, float32 to e4m3fn
codes). The dependency runs one way: core, records, then fence and signals.

Backends. The same source runs compiled on NVIDIA GPUs and under Triton's
interpreter on the host backend. The few primitives whose instructions differ live
in one module per backend (``symmsync.language.prims_compiled``, ``symmsync.language.prims_interpreted``,
the same names in both); :mod:`symmsync.language.core` imports one of them once, when it
is imported (``INTERPRETED``, from :func:`symmsync.backends.mode.kernels_interpreted`), never at run
time:

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
index report      ``index_fail``          ``printf`` and ``trap``             raises IndexCheckError
co-residency      ``check_co_resident``   none (checked before the launch)    refuses a grid of > 1 program
================  ======================  ==================================  ===============================

:func:`clock_ns` and :func:`trap` are public here too.
"""

from __future__ import annotations

import triton.language as tl

from . import calls as _calls
from . import cells, records
from .calls import call_number, check_call, end_call, fence_call, post_call, posted_refusal
from .core import (
    ABORT_FLAG,
    ABORTED_STATUS,
    ARRIVALS,
    ARRIVED,
    COUNT_MASK,
    DEBUG,
    EPOCH,
    EQ,
    GE,
    GT,
    INTERPRETED,
    LANES,
    LE,
    LT,
    NE,
    REASON,
    SLOTS,
    TIMED_OUT_STATUS,
    clock_ns,
    record_barrier,
    trap,
)
from .fence import (
    epoch_ptr,
    grid_fence,
    grid_sync,
    mark_abort,
    peer_ptr,
    pending,
    publish,
    publish_and_wait,
    translate,
    wait,
    wait_or_trap,
)
from .records import write_timeout_record
from .signals import ADD, SET, data_ptr, put_signal, read_signal, signal, wait_count, wait_signal

__all__ = [
    "CALL_OK",
    "MISMATCH",
    "REFUSED",
    "REFUSED_DEVICE",
    "REFUSED_HOST",
    "REFUSED_NONE",
    "WAIT_FAILED",
    "call_number",
    "check_call",
    "end_call",
    "fence_call",
    "post_call",
    "posted_refusal",
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

#: int64 words of an abort reason: code, text length in bytes, then the UTF-8 text.
REASON_WORDS: int = cells.REASON_WORDS
#: Bytes of reason text a cell holds (the words after the code and the length).
REASON_TEXT_BYTES: int = cells.REASON_TEXT_BYTES
#: Reason codes (word 0 of a reason): the member closed its buffer; it failed (any other cause).
REASON_CLOSED: int = cells.REASON_CLOSED
REASON_ERROR: int = cells.REASON_ERROR

#: A call's status (:func:`check_call`, :func:`end_call`; the status word of a consumer): it went
#: well; a member refused it; the members' calls differed; a wait of it failed.
CALL_OK = tl.constexpr(_calls.OK)
REFUSED = tl.constexpr(_calls.REFUSED)
MISMATCH = tl.constexpr(_calls.MISMATCH)
WAIT_FAILED = tl.constexpr(_calls.WAIT_FAILED)
#: A refusal's code (the ``refused`` of :func:`post_call`): none; this member's host refused its
#: arguments (the reason it staged goes with the header); a consumer's own codes from
#: REFUSED_DEVICE up (found in a kernel).
REFUSED_NONE = tl.constexpr(_calls.REFUSED_NONE)
REFUSED_HOST = tl.constexpr(_calls.REFUSED_HOST)
REFUSED_DEVICE = tl.constexpr(_calls.REFUSED_DEVICE)

#: The flag value that marks a record as a timeout ("SYMMTIME").
TIMED_OUT = tl.constexpr(records.TIMED_OUT)
#: The flag value that marks a record as an abort seen ("SYMMABRT").
ABORTED = tl.constexpr(records.ABORTED)
