"""How the members of a dispatcher hand rows to each other: the one place of its synchronization.

A dispatch and a combine are each one *step*, three launches on the stream, every member
running the same steps in the same order (``W`` members, ``n`` the step's number, counted on
the device, per kind of step: dispatches and combines apart)::

    q = n % 2                                   # parity():  which copy of the regions
    1. send:    store this member's rows into every receiver's region [q]   (plain stores)
    2. notify:  counts into every receiver's region [q]; block barrier;
                signal(m, SLOT, ADD 1) for every member m (itself too)     [release, system]
                wait_count(m, SLOT, 1) for every member m, bounded          [acquire, system]
                status = 0 if every wait returned 0; n += 1
    3. read:    q = (n - 1) % 2  (finished_parity());  when status == 0, read this
                member's own region [q]: the rows and counts every member sent it

Why a row is read only once it is whole: a member's step-2 signal to ``m`` is a release
after its step-1 stores (a kernel earlier on the stream) and its step-2 count stores (the
block barrier); ``m`` reads only after its counted wait for that signal (acquire), in a
later launch. A wait that times out or sees an abort leaves ``status`` nonzero and the read
stores zeros (the host raises first on the host backend; a GPU traps): nothing half-sent is
ever read as data.

Why a region is never overwritten while a member still reads it: member ``s`` writes
member ``r``'s region [q] in step ``n + 2`` only after its step ``n + 1`` waited for ``r``'s step
``n + 1`` signal, which ``r`` sends after its step ``n`` read (stream order): the previous
contents of [q] were step ``n``'s. A member one step ahead writes the other parity. The
counted waits compare with ``>=`` from a device-resident base, so a captured graph replays
the steps with no reset. ``verify/moe.pml`` model-checks this (and finds the overwrite
once the parity is taken away).

These functions are the seam the tests reach: ``tests/moe/test_moe_bites.py`` replaces
them (the interpreter resolves a kernel's module attributes when it runs) to show that each
step bites.
"""

from __future__ import annotations

import triton
import triton.language as tl

import symmsync.language as ssl

#: The kinds of step, each with its signal slot and its two words of the dispatcher's state
#: (``state[2 * kind]``: steps started, ``state[2 * kind + 1]``: the last step's status).
DISPATCH, COMBINE = 0, 1
SLOTS = 2


@triton.jit
def parity(state, KIND: tl.constexpr):
    """The parity of the step in progress (read before its notify)."""
    return tl.load(state + 2 * KIND) % 2


@triton.jit
def finished_parity(state, KIND: tl.constexpr):
    """The parity of the step whose notify ran last (read after it, in the read launch)."""
    return (tl.load(state + 2 * KIND) - 1) % 2


@triton.jit
def status(state, KIND: tl.constexpr):
    """0 when every wait of the last step's notify returned 0."""
    return tl.load(state + 2 * KIND + 1)


@triton.jit
def notify_and_wait(
    sig,
    me,
    timeout_ns,
    record,
    state,
    KIND: tl.constexpr,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    """Step 2's synchronization, from one program: signal every member on the step's slot
    (release: after everything this member stored for the step), then a bounded counted
    wait for every member's signal; record the status and count the step."""
    tl.debug_barrier()  # every thread's count stores before the releases
    for m in tl.static_range(SIZE):
        ssl.signal(sig, me, m, KIND, 1, ssl.ADD, NSLOTS)
    failed = me * 0
    for m in tl.static_range(SIZE):
        if failed == 0:  # after a failed wait, the others are not awaited (one record, one budget)
            failed += ssl.wait_count(sig, me, m, KIND, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
    tl.store(state + 2 * KIND + 1, failed.to(tl.int64))
    tl.store(state + 2 * KIND, tl.load(state + 2 * KIND) + 1)
