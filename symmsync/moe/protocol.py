"""How the members of a dispatcher hand rows to each other: the one place of its synchronization.

A dispatch and a combine are each one *step* of two launches on the stream, every member
running the same steps in the same order (``W`` members, ``n`` the step's number: the consumer
kit's call number, counted on the device, one count for dispatches and combines together)::

    q = n % 2                                   # parity(): which copy of the regions
    1. send (many programs):  store this member's rows into every receiver's region [q] of the
                step's kind (a dispatch also: its count of those rows for each of the
                receiver's experts, the programs sharing the experts); arrive on this member's
                counter (acq_rel, GPU scope); the last program to arrive notifies (notify()):
                  post_call(n, kind, refusal): this member's call header, with its refusal if
                  any, into every member's header memory (the kit's); block barrier;
                  signal(m, 0, ADD 1) for every member m (itself too)         [release, system]
    2. read (many programs):  each program waits until every member's signal count reached
                n + 1 (wait_signal GE, bounded; acquire, system), then checks every member's
                header (check(): the kit's check_call): when every wait returned, every header
                is this step's and no member refused its call, it reads this member's own
                region [q] (the rows and counts every member sent it) into the outputs; else
                it reads nothing, and the outputs say so (counts 0; a combine's rows NaN).
                Every program ends the step (the kit's end_call: the last one keeps a failure
                for the host and counts the step, n += 1).

Why a row (or a count) is read only once it is whole: each send program's stores precede its release on
the arrival counter; the last program acquires every arrival before its signals, which
release at system scope (causality is transitive across the two scopes, as the fence's
``arrive`` argues); a member reads only after its wait observed that signal (acquire), in a
later launch. A wait that times out or sees an abort fails the step (``WAIT_FAILED``): nothing
half-sent is ever read as data (the host raises first on the host backend; a GPU traps).

Why a step is read only when every member made the same one: the header a member posts
before its signal says which step it made (its number and kind); a member compares every
member's header with its own before reading. A dispatch on one member against a combine on
another (or members whose counts of steps differ) is found there, on every member
(``MISMATCH``), instead of a wait that runs out its budget: the host raises
:class:`~symmsync.moe.StepMismatch`, and the dispatcher fails.

Why a bad input fails one step and nothing else: a member whose call is refused (its
arguments failed the host's checks, or its send programs found an expert id out of range on
the device) still makes the step: it sends no rows, and its header says why (the kit's
``REFUSED_HOST`` with its reason, or :data:`REFUSED_EXPERT_ID` with the entry and its value).
Every member sees it in its check (``REFUSED``) and reads nothing; the step is counted like
any other, so the next step of every member is in step: the refusal fails that call only, on
every member (the member itself :class:`~symmsync.InputError`, the others
:class:`~symmsync.PeerRefused`).

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
from symmsync.language import calls as ssl_calls

#: The kinds of step (a call header's kind).
DISPATCH, COMBINE = 0, 1
#: The signal slots a dispatcher's :class:`~symmsync.Signals` has: one, for every step.
SLOTS = 1
#: ``state`` words, on the device (the step's own; its header and outcome are the kit's).
#: ``SENT``: the send launch's arrival counter (0 between launches). ``FAILED``: a read program's
#: wait failed (the others need not wait). ``BAD``, ``BAD_WHERE``, ``BAD_VALUE``: this member's
#: earliest expert id out of range in the step being sent, in (token, entry) order
#: (:func:`refuse_id`, :func:`keep_id`).
SENT, FAILED, BAD, BAD_WHERE, BAD_VALUE = range(5)
STATE_WORDS = 5
#: The refusal code of an expert id out of range (the kit's first code of a consumer's own).
REFUSED_EXPERT_ID = ssl_calls.REFUSED_DEVICE

_SENT, _FAILED, _BAD, _BAD_WHERE, _BAD_VALUE = (tl.constexpr(w) for w in (SENT, FAILED, BAD, BAD_WHERE, BAD_VALUE))
_REFUSED_HOST = tl.constexpr(ssl_calls.REFUSED_HOST)
_REFUSED_EXPERT_ID = tl.constexpr(REFUSED_EXPERT_ID)
_FIRST = tl.constexpr(1 << 62)  # more than any entry's index: refuse_id's mark of the earliest one


@triton.jit
def parity(calls):
    """The parity of the step in progress (its number, the kit's count of calls, modulo 2)."""
    return ssl.call_number(calls) % 2


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
def notify(calls, sig, me, state, refused, KIND: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr):
    """The send launch's last program, after the step's stores: this member's call header of the
    step, with its refusal (``refused``: its arguments, found on the host; else an expert id a send
    program kept), into every member's header memory, then signal every member (release:
    everything this member stored for the step first)."""
    bad = tl.load(state + _BAD)
    code = tl.where(refused != 0, _REFUSED_HOST, tl.where(bad != 0, _REFUSED_EXPERT_ID, 0)).to(tl.int64)
    where = tl.where(code == _REFUSED_EXPERT_ID, tl.load(state + _BAD_WHERE), 0)
    value = tl.where(code == _REFUSED_EXPERT_ID, tl.load(state + _BAD_VALUE), 0)
    ssl.post_call(calls, me, ssl.call_number(calls), KIND, 0, 0, 0, 0, code, where, value, SIZE)
    tl.store(state + _BAD, 0)
    tl.store(state + _BAD_WHERE, 0)
    tl.store(state + _BAD_VALUE, 0)
    tl.debug_barrier()  # every thread's header stores before the releases
    for m in tl.static_range(SIZE):
        ssl.signal(sig, me, m, 0, 1, ssl.ADD, NSLOTS)


@triton.jit
def check(
    calls, sig, me, timeout_ns, record, state,
    KIND: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
):  # fmt: skip
    """A read program's synchronization: wait for every member's signal of this step, then check
    every member's header (the kit's :func:`~symmsync.language.check_call`). Returns ``(n, status,
    who)``: the step's number, ``CALL_OK`` when the step may be read (else ``WAIT_FAILED``,
    ``MISMATCH`` or ``REFUSED``), and the member concerned."""
    n = ssl.call_number(calls)
    failed = tl.load(state + _FAILED, volatile=True)  # a program before this one gave up: do not wait again
    if failed == 0:
        for m in tl.static_range(SIZE):
            if failed == 0:  # after a failed wait, the others are not awaited (one record, one budget)
                failed += ssl.wait_signal(sig, me, m, 0, n + 1, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)
        if failed != 0:
            tl.store(state + _FAILED, 1)
    status, who = ssl.check_call(calls, me, n, KIND, 0, 0, 0, 0, ssl.posted_refusal(calls), SIZE)
    status = tl.where(failed != 0, ssl.WAIT_FAILED, status)
    who = tl.where(failed != 0, -1, who)
    return n, status, who


@triton.jit
def finish(calls, me, n, state, status, who, KIND: tl.constexpr, SIZE: tl.constexpr):
    """Every program of a read launch, at its end: the kit's :func:`~symmsync.language.end_call`
    (the last one keeps a failed step for the host and counts the step), and the last one clears
    the step's own words for the next."""
    if ssl.end_call(calls, me, n, KIND, status, who, SIZE, True):
        tl.store(state + _FAILED, 0)
