"""How the members of a dispatcher hand rows to each other: the one place of its synchronization.

A dispatch and a combine are each one *step* of two launches on the stream, every member
running the same steps in the same order (``W`` members, ``n`` the step's number, counted on
the device, one count for dispatches and combines together)::

    q = n % 2                                   # parity(): which copy of the regions
    1. send (many programs):  store this member's rows into every receiver's region [q] of the
                step's kind (a dispatch also: its count of those rows for each of the
                receiver's experts, the programs sharing the experts); arrive on this member's
                counter (acq_rel, GPU scope); the last program to arrive notifies (notify()):
                  header(n, kind) and this member's refusal, if any, into every member's
                  headers[q][this member]; block barrier;
                  signal(m, 0, ADD 1) for every member m (itself too)         [release, system]
    2. read (many programs):  each program waits until every member's signal count reached
                n + 1 (wait_signal GE, bounded; acquire, system), then compares every member's
                header with its own (check()): when every wait returned, every header is this
                step's and no member refused its call, it reads this member's own region [q]
                (the rows and counts every member sent it) into the outputs; else nothing.
                The last program to arrive records the step's status and counts the step
                (finish(): n += 1); a failed step's record stays until the host reads it.

Why a row (or a count) is read only once it is whole: each send program's stores precede its release on
the arrival counter; the last program acquires every arrival before its signals, which
release at system scope (causality is transitive across the two scopes, as the fence's
``arrive`` argues); a member reads only after its wait observed that signal (acquire), in a
later launch. A wait that times out or sees an abort fails the step (``WAIT_FAILED``): nothing
half-sent is ever read as data (the host raises first on the host backend; a GPU traps).

Why a step is read only when every member made the same one: the header a member stores
before its signal says which step it made (its number and kind); a member compares every
member's header with its own before reading. A dispatch on one member against a combine on
another (or members whose counts of steps differ) is found there, on every member
(``MISMATCH``), instead of a wait that runs out its budget: the host raises
:class:`~symmsync.moe.StepMismatch`, and the dispatcher fails.

Why a bad input fails one step and nothing else: a member whose call is refused (its
arguments failed the host's checks, or its send programs found an expert id out of range on
the device) still makes the step: it sends no rows, and its header says why
(``REFUSED_ARGUMENTS``, ``REFUSED_EXPERT_ID`` with the entry and its value). Every member sees
it in its check (``REFUSED``) and reads nothing; the step is counted like any other, so the
next step of every member is in step: the refusal fails that call only, on every member
(the member itself :class:`~symmsync.InputError`, the others :class:`~symmsync.PeerRefused`).

Why a region is never overwritten while a member still reads it: member ``s`` writes member
``r``'s region [q] (of either kind, and its header [q]) in step ``n + 2`` only after its step
``n + 1`` read launch, whose programs waited for ``r``'s step ``n + 1`` signal, which ``r``
sends after its step ``n`` read launch (stream order): the previous contents of [q] were step
``n``'s or earlier. A member one step ahead writes the other parity. The waits compare the
signal count with ``n + 1`` read from the device-resident step counter, never a number the
host computed, so a captured graph replays the steps with no reset. ``verify/moe.pml``
model-checks this (and finds the overwrite once the parity is taken away, and a step read as
another's once the header check is).

Why signals and not a fence channel: the steps need what a fence gives (every member's
arrival, counted on the device, one count for both kinds: an epoch), and a signal slot is
that with the wait in every program that needs it (a fence's wait is one program's) and no
cell of the view's channels taken: a dispatcher leaves every fence channel to the
collectives beside it on the view, and its waits end on an abort, a closed buffer, or a dead
member like a fence's.

These functions are the seam the tests reach: ``tests/moe/test_moe_bites.py`` replaces
them (the interpreter resolves a kernel's module attributes when it runs) to show that each
part bites.
"""

from __future__ import annotations

import triton
import triton.language as tl

import symmsync.language as ssl

#: The kinds of step (a header's low bit).
DISPATCH, COMBINE = 0, 1
#: The signal slots a dispatcher's :class:`~symmsync.Signals` has: one, for every step.
SLOTS = 1
#: ``state`` words, on the device. ``STEPS``: steps made. The earliest failed step the host has
#: not settled (:func:`finish`; ``STATUS`` :data:`OK` when there is none): ``STEP`` (its
#: header: its number and kind), ``STATUS``, and for a mismatch or a refusal the member (its
#: index in the view) ``WHO``, and ``WHAT`` (its header, or its refusal's code), ``WHERE`` and
#: ``VALUE`` (a refused expert id's entry ``t * top_k + k`` and value); ``LATER``: the failed
#: steps after it. ``SENT``, ``DONE``: the send and read launches' arrival counters (0 between
#: launches). ``FAILED``: a read program's wait failed (the others need not wait). ``BAD``,
#: ``BAD_WHERE``, ``BAD_VALUE``: this member's earliest expert id out of range in the step
#: being sent, in (token, entry) order (:func:`refuse_id`, :func:`keep_id`). ``MINE``: this
#: member refused the step being made on the host (its call raised at once, :func:`notify`).
STEPS, STATUS, WHO, WHAT, WHERE, VALUE, SENT, DONE, FAILED, BAD, BAD_WHERE, BAD_VALUE, STEP, LATER, MINE = range(15)
STATE_WORDS = 15
#: Words of a member's header: the step's header, its refusal code, where, value.
HEADER_WORDS = 4
#: A step's status: every wait returned, every header matched and nobody refused; a wait
#: failed; a header differed; a member refused its call.
OK, WAIT_FAILED, MISMATCH, REFUSED = 0, 1, 2, 3
#: A refusal's code in a header: none, the member's arguments (its host checks), an expert id.
REFUSED_NONE, REFUSED_ARGUMENTS, REFUSED_EXPERT_ID = 0, 1, 2

_STEPS, _STATUS, _WHO, _WHAT, _WHERE, _VALUE = (tl.constexpr(w) for w in (STEPS, STATUS, WHO, WHAT, WHERE, VALUE))
_SENT, _DONE, _FAILED, _BAD, _BAD_WHERE, _BAD_VALUE, _STEP, _LATER, _MINE = (
    tl.constexpr(w) for w in (SENT, DONE, FAILED, BAD, BAD_WHERE, BAD_VALUE, STEP, LATER, MINE)
)
_HW = tl.constexpr(HEADER_WORDS)
_OK, _WAIT_FAILED, _REFUSED = (tl.constexpr(s) for s in (OK, WAIT_FAILED, REFUSED))
_FIRST = tl.constexpr(1 << 62)  # more than any entry's index: refuse_id's mark of the earliest one


def header(n: int, kind: int) -> int:
    """The header of step ``n`` of ``kind`` (what the kernels store and compare): ``2 n + kind + 1``
    (never 0, which a workspace holds before its first step)."""
    return 2 * n + kind + 1


def step_of(h: int) -> tuple[str, int]:
    """A step's kind in words (``"dispatch"``, ``"combine"``) and its number, from its header."""
    n, kind = divmod(h - 1, 2)
    return ("dispatch" if kind == DISPATCH else "combine"), n


def describe(h: int) -> str:
    """A header in words (``"dispatch (step 3)"``: the step's kind and number)."""
    if h <= 0:
        return "no step yet"
    kind, n = step_of(h)
    return f"{kind} (step {n})"


@triton.jit
def _header(n, KIND: tl.constexpr):
    """:func:`header` on the device."""
    return 2 * n + KIND + 1


@triton.jit
def parity(state):
    """The parity of the step in progress."""
    return tl.load(state + _STEPS) % 2


@triton.jit
def arrive_last(state, WORD: tl.constexpr, total):
    """Count this program's arrival on ``state[WORD]`` (acq_rel, GPU scope, after a block barrier:
    this program's stores first); True for the last of ``total``, which resets the counter."""
    tl.debug_barrier()
    n = tl.atomic_add(state + WORD, 1, sem="acq_rel", scope="gpu")
    last = n == total - 1
    if last:
        tl.atomic_xchg(state + WORD, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def refuse_id(state, where):
    """A send program found an expert id out of range at entry ``where`` (``t * top_k + k``):
    keep the earliest such entry of the step, in (token, entry) order, whichever program finds
    its own first (``BAD_WHERE`` holds ``_FIRST - where``, raised by an atomic max from 0)."""
    first = tl.full((), _FIRST, tl.int64)  # an int64 tensor: the interpreter's atomic takes no constexpr sum
    tl.atomic_max(state + _BAD_WHERE, first - where.to(tl.int64), sem="relaxed", scope="gpu")


@triton.jit
def keep_id(state, topk):
    """The dispatch send's last program, before :func:`notify`: the earliest refused entry
    (every program's :func:`refuse_id` came before its arrival) and its value, read from the
    ids, into ``BAD``, ``BAD_WHERE``, ``BAD_VALUE``."""
    mark = tl.load(state + _BAD_WHERE, volatile=True)
    if mark != 0:
        where = _FIRST - mark
        tl.store(state + _BAD, 1)
        tl.store(state + _BAD_WHERE, where)
        tl.store(state + _BAD_VALUE, tl.load(topk + where))


@triton.jit
def notify(sig, me, state, headers_off, refused, KIND: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr):
    """The send launch's last program, after the step's stores: this step's header and this
    member's refusal (``refused``: its arguments, found on the host, kept in ``MINE`` for
    :func:`finish`; else an expert id a send program kept) into every member's headers, then
    signal every member (release: everything this member stored for the step first)."""
    n = tl.load(state + _STEPS)
    q = n % 2
    bad = tl.load(state + _BAD)
    tl.store(state + _MINE, refused)
    code = tl.where(refused != 0, 1, tl.where(bad != 0, 2, 0)).to(tl.int64)  # REFUSED_*
    where = tl.where(code == 2, tl.load(state + _BAD_WHERE), 0)
    value = tl.where(code == 2, tl.load(state + _BAD_VALUE), 0)
    for m in tl.static_range(SIZE):
        h = ssl.data_ptr(sig, m, headers_off + (q * SIZE + me) * _HW * 8, tl.int64)
        tl.store(h, _header(n, KIND))
        tl.store(h + 1, code)
        tl.store(h + 2, where)
        tl.store(h + 3, value)
    tl.debug_barrier()  # every thread's header stores before the releases
    for m in tl.static_range(SIZE):
        ssl.signal(sig, me, m, 0, 1, ssl.ADD, NSLOTS)


@triton.jit
def check(
    sig, me, timeout_ns, record, state, headers_off,
    KIND: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
):  # fmt: skip
    """A read program's synchronization: wait for every member's signal of this step, then
    compare every member's header with this step's. Returns ``(status, who, what, where,
    value)`` (:data:`OK` and zeros when the step may be read)."""
    n = tl.load(state + _STEPS)
    q = n % 2
    mine = _header(n, KIND)
    failed = tl.load(state + _FAILED, volatile=True)  # a program before this one gave up: do not wait again
    if failed == 0:
        for m in tl.static_range(SIZE):
            if failed == 0:  # after a failed wait, the others are not awaited (one record, one budget)
                failed += ssl.wait_signal(sig, me, m, 0, n + 1, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)
        if failed != 0:
            tl.store(state + _FAILED, 1)
    status = tl.where(failed != 0, 1, 0).to(tl.int64)  # WAIT_FAILED
    who = tl.full((), -1, tl.int64)  # not from ``me``: a launch may pass it as the constant 1
    what = tl.full((), 0, tl.int64)
    where = what
    value = what
    if failed == 0:
        own = ssl.data_ptr(sig, me, headers_off + q * SIZE * _HW * 8, tl.int64)
        for m in tl.static_range(SIZE):  # a step that differs first, then a refusal
            h = tl.load(own + m * _HW, volatile=True)
            if (h != mine) & (who < 0):
                who = m + who * 0
                what = h
        if who >= 0:
            status = (what * 0 + 2).to(tl.int64)  # MISMATCH
        else:
            for m in tl.static_range(SIZE):
                code = tl.load(own + m * _HW + 1, volatile=True)
                if (code != 0) & (who < 0):
                    who = m + who * 0
                    what = code
                    where = tl.load(own + m * _HW + 2, volatile=True)
                    value = tl.load(own + m * _HW + 3, volatile=True)
            if who >= 0:
                status = (what * 0 + 3).to(tl.int64)  # REFUSED
    return status, who, what, where, value


@triton.jit
def finish(state, status, who, what, where, value, KIND: tl.constexpr):
    """The read launch's last program: record the step's outcome (a failed wait of any program
    first) and count the step; the next step starts clean. A failed step is kept until the host
    settles it (resets ``STATUS``), whatever steps come after it (they count in ``LATER``): on
    GPUs the host reads the outcome at its next synchronization, not after each step, and a
    refused step's zeros are never taken for data because a later step went well. A refusal of
    this member's own arguments is not kept: its call raised on the host at once."""
    failed = tl.load(state + _FAILED, volatile=True)
    status = tl.where(failed != 0, _WAIT_FAILED, status)
    who = tl.where(failed != 0, -1, who)
    mine = tl.load(state + _MINE)
    n = tl.load(state + _STEPS)
    if (status != _OK) & ((status != _REFUSED) | (mine == 0)):  # a failure the host has not raised yet
        if tl.load(state + _STATUS) == _OK:  # the earliest one
            tl.store(state + _STATUS, status)
            tl.store(state + _WHO, who)
            tl.store(state + _WHAT, what)
            tl.store(state + _WHERE, where)
            tl.store(state + _VALUE, value)
            tl.store(state + _STEP, _header(n, KIND))
        else:
            tl.store(state + _LATER, tl.load(state + _LATER) + 1)
    tl.store(state + _FAILED, 0)
    tl.store(state + _BAD, 0)
    tl.store(state + _BAD_WHERE, 0)
    tl.store(state + _MINE, 0)
    tl.store(state + _STEPS, n + 1)
