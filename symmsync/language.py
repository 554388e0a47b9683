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
                 its member, so it always equals that member's epoch.

A fence orders visibility; it does not stop a fast peer from overwriting memory a
slow rank still reads: double-buffer reused payload (by epoch parity) or fence twice.

The layout of a cell (the same byte offset ``cell`` in every member's memory)::

    cell + 0     int64 epoch      this rank's epoch counter for the channel (device-resident)
    cell + 8     int64 arrivals   programs of the current launch that reached grid_fence()
    cell + 128   int64 slot[n]    slot j: how many times member j published to this rank
                                  (its epoch)

Backends. The same source runs compiled on NVIDIA GPUs and under Triton's
interpreter on the host backend; the instructions that differ are picked when this
module is imported (``INTERPRETED``), never at run time:

================  =================================  ===============================
operation         GPU (compiled)                     host (interpreter)
================  =================================  ===============================
publish           ``red.release.sys.global.add``     ``atomic_add`` release (a real
                  (no reply round trip)              lock-free atomic across processes)
wait load         ``ld.acquire.sys.global.b64``      ``atomic_add(0)`` acquire
clock             ``%globaltimer`` (ns)              ``time.monotonic_ns()``
trap              ``trap`` (stream stops)            none: the host reads the status
================  =================================  ===============================
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backends import interpreter_active

#: True when this process runs Triton kernels under the interpreter (host backend).
INTERPRETED: bool = interpreter_active()

#: Lanes per pass when polling the members of a view: one member per lane.
LANES = tl.constexpr(32)
#: Byte offset of the slots inside a cell (the epoch line comes first).
SLOTS = tl.constexpr(128)

#: ``record`` layout written by :func:`write_timeout_record` (int64 words).
RECORD_FLAG, RECORD_EPOCH, RECORD_INDEX, RECORD_SIZE, RECORD_SLOTS = 0, 1, 2, 3, 4
#: The flag value that marks a record as a timeout ("SYMMTIME").
TIMED_OUT = tl.constexpr(0x5359_4D4D_5449_4D45)

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

        return count(p != me and load_acquire_sys(&mem[me].cell.slot[p]) < epoch)
    """
    slots = (tl.load(ptrs + me) + cell + SLOTS).to(tl.pointer_type(tl.int64))
    n = 0
    for base in tl.static_range(0, SIZE, LANES):
        idx = base + tl.arange(0, LANES)
        live = (idx < SIZE) & (idx != me)
        v = _load_acquire(slots + tl.where(idx < SIZE, idx, me))
        n += tl.sum(((v < epoch) & live).to(tl.int32), axis=0)
    return n


@triton.jit
def wait(ptrs, cell, me, epoch, timeout_ns, SIZE: tl.constexpr):
    """Wait until every other member's slot for this rank holds >= ``epoch``; bounded.

    Pseudocode::

        while pending(epoch) > 0:                 # acquire loads at system scope
            if clock_ns() - start > timeout_ns:   # (start: the clock at the first failed poll)
                return 1                          # timed out: do NOT read peer data
        return 0

    Contract: after a 0, reads see every write the members made before they published
    ``epoch`` (see :func:`publish`). After a 1, nothing is guaranteed: write a record
    (:func:`write_timeout_record`) and :func:`trap`, or report the status to the host.
    Graph-safe. Cost: one acquire load per member per poll; the first poll usually
    succeeds when the members are in step.
    """
    left = pending(ptrs, cell, me, epoch, SIZE)
    if left > 0:  # the clock is read only when the first poll did not succeed
        start = _clock_ns()
        elapsed = start - start
        while (left > 0) & (elapsed <= timeout_ns):
            left = pending(ptrs, cell, me, epoch, SIZE)
            elapsed = _clock_ns() - start
    return (left > 0).to(tl.int32)


@triton.jit
def write_timeout_record(record, ptrs, cell, me, epoch, SIZE: tl.constexpr):
    """Write what a timed-out wait saw to ``record`` (int64 words), then a system fence.

    Layout: ``[TIMED_OUT, epoch, me, SIZE, slot[0], ..., slot[SIZE-1]]``; the host turns
    it into a :class:`~symmsync.FenceTimeout` that names the late members.
    """
    slots = (tl.load(ptrs + me) + cell + SLOTS).to(tl.pointer_type(tl.int64))
    rec = record.to(tl.pointer_type(tl.int64))
    for base in tl.static_range(0, SIZE, LANES):
        idx = base + tl.arange(0, LANES)
        v = _load_acquire(slots + tl.where(idx < SIZE, idx, me))
        tl.store(rec + 4 + idx, tl.where(idx == me, epoch, v), mask=idx < SIZE)
    tl.store(rec + 1, epoch)
    tl.store(rec + 2, me)
    tl.store(rec + 3, SIZE)
    tl.store(rec, TIMED_OUT)
    _system_fence()


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
    """:func:`wait` for ``epoch``; on timeout write ``record`` and, if ``TRAP``, :func:`trap`.

    Returns the wait status (0: arrived). With ``TRAP`` (the GPU default) a timed-out
    kernel never returns, so nothing downstream on the stream runs on stale data.
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
