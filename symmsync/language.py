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

Memory model (the contract, on both backends)::

    e = publish(): advances this rank's epoch to e and releases it to every member: every
                 write this rank made before it, from this kernel (after a block barrier)
                 and from kernels earlier on the stream, happens-before any read by a
                 member that observed slot >= e.                    [release, system scope]
    wait(e):     returns 0 only once every other member's slot for this rank holds >= e;
                 reads after it see everything those members wrote before publish(e).
                                                                    [acquire, system scope]
    epochs:      int64, only grow; compared with >=, never ==, so a member one fence ahead
                 is harmless and nothing ever needs a reset. A slot counts the publishes of
                 its member (bits 0..62), so it always equals that member's epoch.
    abort:       mark_abort() writes a reason into this rank's own cell line, then sets the
                 sign bit (ABORT_FLAG) of its slot at every other member [release, system
                 scope]. wait(e) compares the COUNT (slot & COUNT_MASK) with e: a member whose
                 count reached e arrived (its data is valid, flag or not); a member whose count
                 is below e and whose flag is set aborted: wait returns 2 at once.

A fence orders visibility; it does not stop a fast peer from overwriting memory a
slow rank still reads: double-buffer reused payload (by epoch parity) or fence twice.

The layout of a cell (the same byte offset ``cell`` in every member's memory)::

    cell + 0     int64 epoch      this rank's epoch counter for the channel (device-resident)
    cell + 8     int64 arrivals   programs of the current launch that reached grid_fence()
    cell + 16    int64 reason[14] this rank's abort reason: code, text length, 96 bytes of
                                  UTF-8 text (written once, before its abort flags)
    cell + 128   int64 slot[n]    slot j: how many times member j published to this rank
                                  (its epoch, bits 0..62) | ABORT_FLAG once member j aborted

Backends. The same source runs compiled on NVIDIA GPUs and under Triton's
interpreter on the host backend; the instructions that differ are picked when this
module is imported (``INTERPRETED``), never at run time:

================  =================================  ===============================
operation         GPU (compiled)                     host (interpreter)
================  =================================  ===============================
publish           ``red.release.sys.global.add``     ``atomic_add`` release (a real
                  (no reply round trip)              lock-free atomic across processes)
abort flag        ``red.release.sys.global.or``      ``atomic_or`` release
wait load         ``ld.acquire.sys.global.b64``      ``atomic_add(0)`` acquire
clock             ``%globaltimer`` (ns)              ``time.monotonic_ns()``
trap              ``trap`` (stream stops)            none: the host reads the status
================  =================================  ===============================
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backends import interpreter_active

INTERPRETED: bool = interpreter_active()
"""True when this process runs Triton kernels under the interpreter (host backend)."""

#: Lanes per pass when polling the members of a view: one member per lane.
LANES = tl.constexpr(32)
#: Byte offset of the slots inside a cell (the epoch line comes first).
SLOTS = tl.constexpr(128)

#: Byte offset of a rank's abort reason inside its own cell line.
REASON = tl.constexpr(16)
#: int64 words of an abort reason: code, text length in bytes, then the UTF-8 text.
REASON_WORDS = 14
#: Bytes of reason text a cell holds (the words after the code and the length).
REASON_TEXT_BYTES = 8 * (REASON_WORDS - 2)
#: Reason codes (word 0 of a reason): the member closed its buffer; it failed (any other cause).
REASON_CLOSED, REASON_ERROR = 1, 2

#: The abort flag of a slot: its sign bit. A slot that carries it is negative, so a plain
#: ``slot >= e`` never takes an abort for an arrival; the count is ``slot & COUNT_MASK``.
ABORT_FLAG = tl.constexpr(-(2**63))
#: The bits of a slot that count publishes.
COUNT_MASK = tl.constexpr(2**63 - 1)

#: ``record`` layout written by :func:`write_timeout_record` (int64 words):
#: ``[flag, epoch, index, SIZE, slot[0..SIZE-1], aborter, reason[REASON_WORDS]]``.
RECORD_FLAG, RECORD_EPOCH, RECORD_INDEX, RECORD_SIZE, RECORD_SLOTS = 0, 1, 2, 3, 4
#: The flag value that marks a record as a timeout ("SYMMTIME").
TIMED_OUT = tl.constexpr(0x5359_4D4D_5449_4D45)
#: The flag value that marks a record as an abort seen ("SYMMABRT").
ABORTED = tl.constexpr(0x5359_4D4D_4142_5254)
#: Wait statuses: every member arrived; the budget ran out; a member aborted.
ARRIVED, TIMED_OUT_STATUS, ABORTED_STATUS = 0, 1, 2


def record_words(size: int) -> int:
    """int64 words of the record of a view of ``size`` members."""
    return RECORD_SLOTS + size + 1 + REASON_WORDS


if INTERPRETED:
    # Under the interpreter these helpers are plain Python called from interpreted
    # kernels (Triton's language is already patched by the caller): every nested
    # @triton.jit call would re-patch it, which costs more than the fence itself.
    import time as _time

    def _clock_ns():
        return tl.full((), _time.monotonic_ns(), tl.int64)

    def _release_add(ptr, live):
        # Interpreter atomics on int64 are lock-free CPU atomics, honouring the order.
        tl.atomic_add(ptr, 1, mask=live, sem="release", scope="sys")

    def _release_or(ptr, value, live):
        tl.atomic_or(ptr, value, mask=live, sem="release", scope="sys")

    def _load_acquire(ptrs):
        return tl.atomic_add(ptrs, 0, sem="acquire", scope="sys")

    def _system_fence():
        pass

    def _trap():
        pass

else:

    @triton.jit
    def _clock_ns():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _release_add(ptr, live):
        # A reduction, not an exchange or a store: atom.exch waits for a reply across
        # NVLink, and red.release.sys measured faster than st.release.sys on 2x H200
        # (benchmarks/fence.py: 1.95 against 2.38 us per fence in graph replay).
        # Exactly once per call: an inline-asm statement runs in every thread that holds
        # its operands (for a scalar, every thread of the program), so only thread 0
        # issues it; otherwise a program of W warps would add once per thread or warp and
        # a slot would run ahead of its member's epoch. Nothing is sent when not ``live``.
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 q, t, 0; "
            "setp.ne.and.s32 p, $2, 0, q; @p red.release.sys.global.add.u64 [$1], 1; }\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [ptr, tl.cast(live, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _release_or(ptr, value, live):
        # The abort flag: the same once-per-call reduction as _release_add (thread 0 only),
        # an OR so that marking twice changes nothing and the count bits stay intact.
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 q, t, 0; "
            "setp.ne.and.s32 p, $3, 0, q; @p red.release.sys.global.or.b64 [$1], $2; }\n\tmov.u32 $0, 0;",
            "=r,l,l,r",
            [ptr, tl.cast(value, tl.int64), tl.cast(live, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _load_acquire(ptrs):
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptrs], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def _system_fence():
        tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _trap():
        tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def epoch_ptr(ptrs, cell, me):
    """Pointer to this rank's int64 epoch counter of the cell (in its own memory)."""
    return (tl.load(ptrs + me) + cell).to(tl.pointer_type(tl.int64))


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

    Base addresses are page aligned, so the difference is a whole number of elements.
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
    each call adds exactly 1 to each peer's slot. Graph-safe.
    Cost: one local load and store, SIZE-1 remote reductions issued back to back and in
    flight together, no reply awaited, nothing sent to itself.
    """
    # The reductions go first: a release waits for this thread's earlier writes, and the
    # epoch store is one it need not wait for (a slot counts publishes, so the value
    # sent does not depend on the epoch).
    for p in tl.static_range(SIZE):
        dst = (tl.load(ptrs + p) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
        _release_add(dst, p != me)
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
        v = _load_acquire(slots + tl.where(idx < SIZE, idx, me))
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
        v = _load_acquire(slots + tl.where(idx < SIZE, idx, me))
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
    1 or a 2, nothing is guaranteed: write a record (:func:`write_timeout_record`) and
    :func:`trap`, or report the status to the host. Graph-safe. Cost: one acquire load
    per member per poll and a mask; the first poll usually succeeds when the members are
    in step, and it reads no flag, clock or reason.
    """
    left = pending(ptrs, cell, me, epoch, SIZE)
    aborted = left * 0
    if left > 0:  # the clock and the flags are read only when the first poll did not succeed
        start = _clock_ns()
        elapsed = start - start
        while (left > 0) & (aborted == 0) & (elapsed <= timeout_ns):
            left, aborted = _poll(ptrs, cell, me, epoch, SIZE)
            elapsed = _clock_ns() - start
    return tl.where(aborted > 0, 2, (left > 0).to(tl.int32)).to(tl.int32)


@triton.jit
def write_timeout_record(record, ptrs, cell, me, epoch, SIZE: tl.constexpr):
    """Write what a failed wait saw to ``record`` (int64 words), then a system fence.

    Layout: ``[flag, epoch, me, SIZE, slot[0], ..., slot[SIZE-1], aborter, reason[14]]``.
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
        v = _load_acquire(slots + tl.where(idx < SIZE, idx, me))
        gone = (idx < SIZE) & (idx != me) & ((v & COUNT_MASK) < epoch) & (v < 0)
        first = tl.minimum(first, tl.min(tl.where(gone, idx, SIZE), axis=0))
        tl.store(rec + 4 + idx, tl.where(idx == me, epoch, v), mask=idx < SIZE)
    # The flag was seen by one thread's acquire load; the reason is read by others: the
    # barrier and the fence order those reads after that load (cumulativity).
    tl.debug_barrier()
    _system_fence()
    w = tl.arange(0, 16)
    found = first < SIZE
    src = (tl.load(ptrs + tl.where(found, first, me)) + cell + REASON).to(tl.pointer_type(tl.int64))
    words = _load_acquire(src + tl.where(w < 14, w, 0))
    tl.store(rec + 5 + SIZE + w, tl.where(found, words, 0), mask=w < 14)
    tl.store(rec + 4 + SIZE, tl.where(found, first, -1))
    tl.store(rec + 1, epoch)
    tl.store(rec + 2, me)
    tl.store(rec + 3, SIZE)
    tl.store(rec, tl.where(found, ABORTED, TIMED_OUT))
    tl.debug_barrier()  # every warp's part of the record is written before any thread traps
    _system_fence()


@triton.jit
def mark_abort(ptrs, cell, me, reason, SIZE: tl.constexpr):
    """Tell every other member that this rank gave up on the cell's channel.

    Pseudocode::

        mem[me].cell.reason[0..13] = reason[0..13]     # code, length, UTF-8 text
        block_barrier()
        for p in 0..SIZE-1, p != me:                   # thread 0
            red_or_release_sys(&mem[p].cell.slot[me], ABORT_FLAG)

    Contract: a member whose wait observes the flag also observes the reason. The count
    bits are untouched, so a member that already saw this rank's publish of an epoch
    still completes its wait for it; a member waiting for a later epoch returns 2 from
    :func:`wait` within one poll. Idempotent (an OR). ``reason`` points at 14 int64
    words (:data:`REASON_WORDS`). Run it from one program, on a stream that is not
    blocked behind this rank's own waits. Cost: 14 local stores, SIZE-1 remote reductions.
    """
    own = (tl.load(ptrs + me) + cell + REASON).to(tl.pointer_type(tl.int64))
    w = tl.arange(0, 16)
    tl.store(own + w, tl.load(reason.to(tl.pointer_type(tl.int64)) + w, mask=w < 14), mask=w < 14)
    tl.debug_barrier()
    for p in tl.static_range(SIZE):
        dst = (tl.load(ptrs + p) + cell + SLOTS).to(tl.pointer_type(tl.int64)) + me
        _release_or(dst, ABORT_FLAG, p != me)


@triton.jit
def trap():
    """Stop the kernel and the stream (GPU); the host sees a CUDA error. No-op on the host
    backend, where the wait's status reaches the host instead."""
    _trap()


@triton.jit
def fence(ptrs, cell, me, timeout_ns, SIZE: tl.constexpr):
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
def fence_or_trap(ptrs, cell, me, epoch, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
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
            e = publish(); fence_or_trap(e)

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
    counter = (tl.load(ptrs + me) + cell + 8).to(tl.pointer_type(tl.int64))
    nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    n = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
    status = (n * 0).to(tl.int32)
    if n == nprog - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        e = publish(ptrs, cell, me, SIZE)
        status = fence_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)
    return status
