"""How the members of a dispatcher hand rows to each other: the one place of its synchronization.

A dispatch and a combine are each one *step* of two launches on the stream, every member
running the same steps in the same order (``W`` members, ``n`` the step's number: the consumer
kit's call number, counted on the device, one count for dispatches and combines together).
Every member adds 2 to its signal slot at every member per step (:data:`PER_STEP`), so a count
of ``2 n + 1`` says "step ``n``'s counts are in" and ``2 n + 2`` "step ``n`` is sent". A dispatch
moves each row once, into its final packed place; its counts travel first::

    q = n % 2                                   # parity(): the copy of the counts (and combine rows)
    b = the host's count of dispatches % 2      # the copy of the rows (its offset: the header's size word)
    dispatch
    1. send (one launch, programs sized by the device):
       A. the program that takes the launch's first ticket (first_in()): this member's count of
          rows for every expert into every member's counts[q] (all zeros when it refuses the
          step); post_call(n, DISPATCH, rows[b], refusal) into every member's header memory (the
          kit's); block barrier; signal(m, 0, ADD 1) for every member m (itself too)
                                                                          [release, system]
       B. every program: wait until every *other* member's count reached 2n + 1 (wait_signal GE,
          bounded; acquire, system), then check every member's header (check(): the kit's
          check_call). When every wait returned, every header is this step's and nobody
          refused: store each of its rows (and source indices; with fp8 codes and scales)
          straight into the receiver's rows[b] at its packed place
              (e % EL) * W * M + sum(counts[q][s'][e] for s' < me) + (this member's tokens before
              t routed to e)
          else store nothing. Arrive on this member's counter (acq_rel, GPU scope); the last
          program to arrive: signal(m, 0, ADD 1) for every member m, unless a wait of this
          launch failed (sent())                                         [release, system]
    2. receive (one program): wait until every member's count reached 2n + 2, check every
       header again; when the step may be read, store this member's counts, per source and in
       all, and the offsets, from counts[q]; else counts 0, per_source -1 (no rows: its combine
       knows). End the step (the kit's end_call: keep a failure for the host, n += 1). The rows
       are in place: nothing is copied. recv is a view of rows[b].
    combine
    1. send: store the expert outputs into the token owners' combine[q]; the last program to
       arrive posts the header and signals every member ADD 2 (both of the step's signals)
    2. reduce: every program waits for every member's 2n + 2, checks the headers, sums its
       tokens' rows (NaN when the step failed); every program ends the step.

Why a row (or a count) is read only once it is whole: each program's stores precede its
release on the arrival counter; the last program acquires every arrival before its signals,
which release at system scope (causality is transitive across the two scopes, as the fence's
``arrive`` argues); a member reads only after its wait observed that signal (acquire), in a
later launch (the receive's wait comes before the user's kernels on the stream). Counts are
stored by the first ticket's program before its own release, and a sender reads the others' counts only after
its wait on 2n + 1 observed them. A wait that times out or sees an abort fails the step
(``WAIT_FAILED``): nothing half-sent is ever read as data (the host raises first on the host
backend; a GPU traps), and a member whose counts wait failed stores no row and withholds its
second signal, so the others' receive waits fail too instead of taking a missing row for data.

Why a sender knows where its rows go before it stores one: the receiver's packed place of a
row depends on every earlier member's count for that expert; phase B stores only after the wait
on 2n + 1, which every member's counts preceded (``verify/moe.pml``'s ``BUG_NOCOUNTWAIT``: a
sender that stores before it has them overwrites an earlier member's rows).

Why a step is read only when every member made the same one: the header a member posts
before its first signal says which step it made (its number, its kind, and a dispatch's buffer
``b``, by its offset); a member compares every member's header with its own before it stores a row and again
before it reads. A dispatch on one member against a combine on another (or members whose
counts of steps differ) is found there, on every member (``MISMATCH``), before any row moves:
the host raises :class:`~symmsync.moe.StepMismatch`, and the dispatcher fails.

Why a bad input fails one step and nothing else: a member whose call is refused (its
arguments failed the host's checks, or its send found an expert id out of range on the
device: the first ticket's program counts every id once) still makes the step: it sends zero
counts and no rows, and its header says why (the kit's ``REFUSED_HOST`` with its reason, or
:data:`REFUSED_EXPERT_ID` with the earliest such entry and its value). Every member sees it in
its checks (``REFUSED``): no member stores a row, and every receive reports no rows; the step
is counted like any other, so the next step of every member is in step: the refusal fails that
call only, on every member (the member itself :class:`~symmsync.InputError`, the others
:class:`~symmsync.PeerRefused`).

Why a region is never overwritten while a member still reads it:

* rows[b] of receiver ``r``: a sender stores step ``n``'s rows only after its wait saw ``r``'s
  count 2n + 1, which ``r`` signals in its step ``n`` send, after everything launched before it
  on ``r``'s stream (its own reads of rows it received earlier, a combine's reads of a handle's
  ``src``). So a dispatch's outputs hold until this member launches the next dispatch into the
  same buffer ``b``: the dispatch after next (``b`` alternates). ``b`` is the host's, not the
  device's: no synchronization rests on it, only the outputs' lifetime; it is a size word of the
  header, so members whose ``b`` differ fail the step (``MISMATCH``) before any row moves.
* counts[q] and combine[q]: member ``s`` writes member ``r``'s copy [q] in step ``n + 2`` only
  after its step ``n + 1`` waits, which saw ``r``'s signals of step ``n + 1``, which ``r`` sends
  after its step ``n`` receive (stream order): the previous contents of [q] were step ``n``'s or
  earlier, and read. A member one step ahead writes the other parity.
* The waits compare the signal count with ``2 n + 1`` or ``2 n + 2``, ``n`` read from the
  device-resident step counter, never a number the host computed, so a captured graph replays
  the steps with no reset. ``verify/moe.pml`` model-checks this (and finds the overwrite once
  the parity is taken away, a step read as another's once the header check is, and rows stored
  at offsets not known yet once the counts wait is).

Why signals and not a fence channel: the steps need what a fence gives (every member's
arrival, counted on the device, one count for both kinds: an epoch), and a signal slot is
that with the wait in every program that needs it (a fence's wait is one program's) and no
cell of the view's channels taken: a dispatcher leaves every fence channel to the
collectives beside it on the view, and its waits end on an abort, a closed buffer, or a dead
member like a fence's.

Why phase B waits inside the send launch, with no launch between the phases: a third launch
per step would cost its launch on the host and a kernel boundary on the device. The wait does
not depend on the launch's own programs (a member's own counts are not awaited: it computes
them), only on every other member's first-ticket program, which runs (it took a ticket) and waits
for nothing before its signal.

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
#: Signals a member adds to every member's slot per step (a dispatch: its counts, then its rows; a
#: combine: both at once), so step ``n``'s counts are in at ``2 n + 1`` and the step at ``2 n + 2``.
PER_STEP = 2
#: The waits of a step (``PHASE`` of :func:`check`): the counts (a dispatch's send), the end.
COUNTS, END = 0, 1
#: ``state`` words, on the device (the step's own; its header and outcome are the kit's).
#: ``SENT``: the send launch's arrival counter (0 between launches). ``FAILED``: a wait of the step
#: failed (the step's later waits are not made: one record, one budget). ``FIRST``: the send launch's
#: tickets (0 between launches): the program that takes the first posts the counts (:func:`first_in`).
SENT, FAILED, FIRST = range(3)
STATE_WORDS = 3
#: The refusal code of an expert id out of range (the kit's first code of a consumer's own).
REFUSED_EXPERT_ID = ssl_calls.REFUSED_DEVICE

_SENT, _FAILED, _FIRST = tl.constexpr(SENT), tl.constexpr(FAILED), tl.constexpr(FIRST)
_REFUSED_HOST = tl.constexpr(ssl_calls.REFUSED_HOST)
_REFUSED_EXPERT_ID = tl.constexpr(REFUSED_EXPERT_ID)
_PER_STEP = tl.constexpr(PER_STEP)
_END = tl.constexpr(END)


@triton.jit
def parity(calls):
    """The parity of the step in progress (its number, the kit's count of calls, modulo 2): which
    copy of the counts and of the combine's rows it uses."""
    return ssl.call_number(calls) % 2


@triton.jit
def refusal(refused, bad):
    """This member's refusal code of a dispatch: ``refused`` (its arguments, found on the host),
    else :data:`REFUSED_EXPERT_ID` when ``bad`` (an expert id out of range), else 0."""
    return tl.where(refused != 0, _REFUSED_HOST, tl.where(bad, _REFUSED_EXPERT_ID, 0)).to(tl.int64)


@triton.jit
def post(calls, sig, me, n, code, where, value, a, KIND: tl.constexpr, SIZE: tl.constexpr,
         NSLOTS: tl.constexpr, VALUE: tl.constexpr):  # fmt: skip
    """One program of a step's send, after the stores it releases: this member's call header of step
    ``n`` (``a``: its size word; ``code``, ``where``, ``value``: its refusal) into every member's header
    memory, then signal every member, ``VALUE`` (release: this member's earlier stores first)."""
    ssl.post_call(calls, me, n, KIND, a, 0, 0, 0, code, where, value, SIZE)
    tl.debug_barrier()  # every thread's stores before the releases
    for m in tl.static_range(SIZE):
        ssl.signal(sig, me, m, 0, VALUE, ssl.ADD, NSLOTS)


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
def first_in(state):
    """True for the one program of a dispatch's send that takes the launch's first ticket: the
    program that posts the counts and header is one that runs, whichever the device started first
    (the others wait for every other member's, never for their own launch's). The last program to
    arrive resets the tickets (:func:`sent_last`)."""
    return tl.atomic_add(state + _FIRST, 1, sem="acq_rel", scope="gpu") == 0


@triton.jit
def sent_last(state, total):
    """:func:`arrive_last` on the send's arrivals, and the last program resets the tickets too
    (every program took its ticket before it arrived)."""
    last = arrive_last(state, _SENT, total)
    if last:
        tl.atomic_xchg(state + _FIRST, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def sent(sig, me, state, SIZE: tl.constexpr, NSLOTS: tl.constexpr):
    """A dispatch's send, its last program (every program's row stores acquired by its arrival):
    signal every member, 1 (release), unless a wait of the step failed here: a member that did not
    see every member's counts stored nothing, and its silence fails the step's end wait everywhere
    (bounded) instead of a receiver taking its missing rows for data."""
    if tl.load(state + _FAILED, volatile=True) == 0:
        for m in tl.static_range(SIZE):
            ssl.signal(sig, me, m, 0, 1, ssl.ADD, NSLOTS)


@triton.jit
def check(
    calls, sig, me, timeout_ns, record, state, a, refused,
    KIND: tl.constexpr, PHASE: tl.constexpr, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr,
):  # fmt: skip
    """A program's synchronization on step ``n``: wait until every member's signal count reached
    ``2 n + 1`` (``PHASE`` :data:`COUNTS`: every member's counts and header; this member's own are
    not awaited) or ``2 n + 2`` (:data:`END`: every member's rows too), then check every member's
    header (the kit's :func:`~symmsync.language.check_call`; ``a``: the step's size word,
    ``refused``: this member's refusal code). Returns ``(n, status, who)``: the step's number,
    ``CALL_OK`` when the step may go on (else ``WAIT_FAILED``, ``MISMATCH`` or ``REFUSED``), and the
    member concerned."""
    n = ssl.call_number(calls)
    target = _PER_STEP * n + 1 + PHASE
    failed = tl.load(state + _FAILED, volatile=True)  # a wait of the step failed before: do not wait again
    if failed == 0:
        for m in tl.static_range(SIZE):
            awaited = (m != me) | (tl.full((), PHASE, tl.int32) == _END)  # the counts: not its own
            if (failed == 0) & awaited:  # after a failed wait, no other
                failed += ssl.wait_signal(sig, me, m, 0, target, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)
        if failed != 0:
            tl.store(state + _FAILED, 1)
    status, who = ssl.check_call(calls, me, n, KIND, a, 0, 0, 0, refused, SIZE)
    status = tl.where(failed != 0, ssl.WAIT_FAILED, status)
    who = tl.where(failed != 0, -1, who)
    return n, status, who


@triton.jit
def finish(calls, me, n, state, status, who, KIND: tl.constexpr, SIZE: tl.constexpr):
    """Every program of a step's last launch, at its end: the kit's :func:`~symmsync.language.end_call`
    (the last one keeps a failed step for the host and counts the step), and the last one clears
    the step's own words for the next."""
    if ssl.end_call(calls, me, n, KIND, status, who, SIZE, True):
        tl.store(state + _FAILED, 0)
