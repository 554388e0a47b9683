"""How the members of a dispatcher hand rows to each other: the one place of its synchronization.

A dispatch and a combine are each one *step*, three launches on the stream, every member
running the same steps in the same order (``W`` members, ``n`` the step's number, counted on
the device, one count for dispatches and combines together)::

    q = n % 2                                   # parity():  which copy of the regions
    1. send:    store this member's rows into every receiver's region [q] of the step's kind
    2. notify:  (dispatch) counts into every receiver's region [q];
                header(n, kind) into every receiver's headers[q][this member]; block barrier;
                signal(m, 0, ADD 1) for every member m (itself too)        [release, system]
                wait_count(m, 0, 1) for every member m, bounded             [acquire, system]
                status = WAIT_FAILED if a wait failed, else MISMATCH if a member's header in
                this member's headers[q] is not header(n, kind) (the member and its header
                kept), else OK; n += 1
    3. read:    q = (n - 1) % 2  (finished_parity());  when status == OK, read this member's
                own region [q]: the rows and counts every member sent it

Why a row is read only once it is whole: a member's step-2 signal to ``m`` is a release
after its step-1 stores (a kernel earlier on the stream) and its step-2 count and header
stores (the block barrier); ``m`` reads only after its counted wait for that signal
(acquire), in a later launch. A wait that times out or sees an abort leaves ``status``
nonzero and the read stores zeros (the host raises first on the host backend; a GPU traps):
nothing half-sent is ever read as data.

Why a step is read only when every member made the same step: the header a member stores
before its signal says which step it made (its number and kind); a member whose wait passed
compares every member's header with its own before reading. A dispatch on one member against
a combine on another (or members whose counts of steps differ) is found there, on every
member, instead of a wait that runs out its budget: the read stores zeros, and the host raises
:class:`~symmsync.moe.StepMismatch` naming the member and the step it made.

Why a region is never overwritten while a member still reads it: member ``s`` writes
member ``r``'s region [q] (of either kind, and its header [q]) in step ``n + 2`` only after its
step ``n + 1`` waited for ``r``'s step ``n + 1`` signal, which ``r`` sends after its step ``n``
read (stream order): the previous contents of [q] were step ``n``'s or earlier. A member one
step ahead writes the other parity. The counted waits compare with ``>=`` from a
device-resident base, so a captured graph replays the steps with no reset. ``verify/moe.pml``
model-checks this (and finds the overwrite once the parity is taken away, and a step read as
another's once the header check is).

Why signals and not a fence channel: the steps need what a fence gives (every member's
arrival, counted from a device-resident base, one count for both kinds: an epoch), and a
signal slot is that with the wait in the kernel that needs it and no cell of the view's
channels taken: a dispatcher leaves every fence channel to the collectives beside it on the
view, and its waits end on an abort, a closed buffer, or a dead member like a fence's.

These functions are the seam the tests reach: ``tests/moe/test_moe_bites.py`` replaces
them (the interpreter resolves a kernel's module attributes when it runs) to show that each
step bites.
"""

from __future__ import annotations

import triton
import triton.language as tl

import symmsync.language as ssl

#: The kinds of step (a header's low bit).
DISPATCH, COMBINE = 0, 1
#: The signal slots a dispatcher's :class:`~symmsync.Signals` has: one, for every step.
SLOTS = 1
#: ``state`` words, on the device: the steps started, the last step's status, and for a
#: mismatch the member (its index in the view) whose header differed and that header.
STEPS, STATUS, WHO, WHAT = 0, 1, 2, 3
STATE_WORDS = 4
_STEPS, _STATUS, _WHO, _WHAT = (tl.constexpr(w) for w in (STEPS, STATUS, WHO, WHAT))
#: A step's status: every wait returned and every header matched; a wait failed; a header differed.
OK, WAIT_FAILED, MISMATCH = 0, 1, 2


def header(n: int, kind: int) -> int:
    """The header of step ``n`` of ``kind`` (what the kernels store and compare): ``2 n + kind + 1``
    (never 0, which a workspace holds before its first step)."""
    return 2 * n + kind + 1


def describe(h: int) -> str:
    """A header in words (``"dispatch 3"``: the step's kind and number), or what a member sent instead."""
    if h <= 0:
        return "no step yet"
    n, kind = divmod(h - 1, 2)
    return f"{'dispatch' if kind == DISPATCH else 'combine'} (step {n})"


@triton.jit
def parity(state):
    """The parity of the step in progress (read before its notify)."""
    return tl.load(state + _STEPS) % 2


@triton.jit
def finished_parity(state):
    """The parity of the step whose notify ran last (read after it, in the read launch)."""
    return (tl.load(state + _STEPS) - 1) % 2


@triton.jit
def status(state):
    """:data:`OK` when every wait of the last step's notify returned and every header matched."""
    return tl.load(state + _STATUS)


@triton.jit
def notify_and_wait(
    sig,
    me,
    timeout_ns,
    record,
    state,
    headers_off,
    KIND: tl.constexpr,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    """Step 2's synchronization, from one program: this step's header into every member's
    headers, signal every member (release: after everything this member stored for the step),
    a bounded counted wait for every member's signal, then every member's header compared
    with this step's; record the status and count the step."""
    n = tl.load(state + _STEPS)
    q = n % 2
    mine = 2 * n + KIND + 1  # header()
    for m in tl.static_range(SIZE):
        tl.store(ssl.data_ptr(sig, m, headers_off + (q * SIZE + me) * 8, tl.int64), mine)
    tl.debug_barrier()  # every thread's count and header stores before the releases
    for m in tl.static_range(SIZE):
        ssl.signal(sig, me, m, 0, 1, ssl.ADD, NSLOTS)
    failed = me * 0
    for m in tl.static_range(SIZE):
        if failed == 0:  # after a failed wait, the others are not awaited (one record, one budget)
            failed += ssl.wait_count(sig, me, m, 0, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
    result = tl.where(failed != 0, 1, 0).to(tl.int64)  # WAIT_FAILED
    who = (me * 0 - 1).to(tl.int64)
    what = (me * 0).to(tl.int64)
    if failed == 0:
        own = ssl.data_ptr(sig, me, headers_off + q * SIZE * 8, tl.int64)
        for m in tl.static_range(SIZE):
            h = tl.load(own + m, volatile=True)
            if (h != mine) & (who < 0):
                who = m + who * 0
                what = h
        result = tl.where(who >= 0, 2, 0).to(tl.int64)  # MISMATCH
    tl.store(state + _WHO, who)
    tl.store(state + _WHAT, what)
    tl.store(state + _STATUS, result)
    tl.store(state + _STEPS, n + 1)
