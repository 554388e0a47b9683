"""How the members of a collective hand their slots to each other: the one place of its synchronization.

Everything the collectives' kernels need to order their memory lives here, built on the
primitives of :mod:`symmsync.language` and the view's fence cell (its device-resident
epoch); the call header is the consumer kit's (:mod:`symmsync.language.calls`). Replacing these
few functions (with per-peer signals, for example) changes the protocol of every operation at
once. The steps are symmsync's own, written once for the fences and the collectives:
:func:`arrive` is :func:`symmsync.language.core.arrive` (with a counter of the collective's own),
:func:`grid_barrier` polls with :func:`symmsync.language.core.bounded_poll`, and the record of a
stalled grid is :mod:`symmsync.language.records`'.

Pseudocode of one call, as every member runs it (``G`` programs, the epoch and the call's
number ``n`` on the device)::

    e = epoch + 1;  q = e % 2                      # parity of this call's input slots (device-side)
    if closed(e): fail_closed(e); return           # a launch kept past close(): fails at once, publishes nothing
    copy x into input[q] (unless the caller filled the symmetric input in place)
    program 0: post_call(n, op, numel, dtype | symmetric, algorithm, epilogue, refused)
    arrive(): the last program of the launch publishes e      [release, system scope]
    wait(e): every member published e                         [acquire, system scope]
    status = check_call(n, ...): every member's header is this call's, nobody refused it
    if status is OK: read the members' input[q] (sum in member order in float32, or copy)
        two-shot / symmetric input: grid_barrier(); arrive(): publish e + 1; wait(e + 1)
    else (a member refused, or the members' calls differ): read nothing, publish nothing more
        (the arrival counter reset), and store NaN into the outputs
    end_call(n, status): the call's failure kept for the host; n + 1

A refused call: the member whose input failed its checks still makes the call, with nothing to
send (``count`` 0) and its header refused, with its reason; every member publishes ``e``
once, sees the refusal after its wait, and reads and stores nothing but the outputs' NaN (a
two-phase call skips its second phase on every member alike), so that every member's epoch
stays in step and the next call goes on. Members whose calls differ do the same, and the
collective fails. The host raises :class:`~symmsync.InputError` on the refusing member,
:class:`~symmsync.PeerRefused` on the others, :class:`~symmsync.collectives.CollectiveMismatch`
on every member for calls that differ.

Why a slot is never overwritten while a member still reads it:

* a member reads another member's slot of epoch ``f`` only between its wait(f) and its
  own next publish (f + 1): the reads of a launch complete before the launch ends, and
  a publish is a release, ordered after them;
* a member writes a slot of parity ``f % 2`` for epoch ``f`` only after its wait(f - 1)
  returned, and the slot's previous contents were for epoch ``f - 2`` or earlier: every
  member published ``f - 1``, so every member finished reading them.
  A one-shot call publishes once, so its slots alternate by parity; a two-shot call
  publishes twice, and its reduced chunk is read before the next call's first publish.
* the symmetric input has one slot (the caller's tensor does not move between calls),
  so a call that reads it publishes a second time after its reads and waits for every
  member's second publish before the kernel ends: the caller may refill it at once.
* the call headers (the kit's memory, by the parity of the call's number) follow the same
  argument one call apart: :mod:`symmsync.language.calls`.

Co-residency (GPUs): every program of a launch waits for the members, and a two-phase
call also waits for every program of its own launch (:func:`grid_barrier`), so the
launch's programs must be resident at once. The collectives launch at most one
program per multiprocessor. Under Triton's interpreter the programs of a launch run
one after another, so the collectives launch one program there.
"""

from __future__ import annotations

import triton
import triton.language as tl

import symmsync.language as ssl
from symmsync.language import core, records
from symmsync.language.cells import CLOSED_EPOCH
from symmsync.language.core import arrive  # noqa: F401 - the collectives' arrival: symmsync's one counter

_CLOSED_EPOCH = tl.constexpr(CLOSED_EPOCH)


@triton.jit
def next_epoch(sptrs, cell, me):
    """The epoch this launch's first publish will return (read before any program arrives)."""
    return tl.load(ssl.epoch_ptr(sptrs, cell, me)) + 1


@triton.jit
def closed(e):
    """True for a launch after this rank's ``close()`` (``e`` from :func:`next_epoch`): its
    epoch is past :data:`symmsync.language.cells.CLOSED_EPOCH`. Such a launch (arguments kept past
    ``close()``) runs :func:`fail_closed` and nothing else: no copy-in, no header, no
    publish (a publish would still count at the members that map this rank's cells and
    could complete a wait of theirs for a call this rank never made)."""
    return e > _CLOSED_EPOCH


@triton.jit
def fail_closed(sptrs, cell, me, e, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """The whole of a launch after ``close()``: a wait for ``e``, which no member's publish
    reaches, with no budget, so it fails at its first polls (record, trap on GPUs); a slot
    that holds a count no member published (a stray store) may pass it, and the launch
    fails all the same, with a timeout record."""
    if wait(sptrs, cell, me, e, 0, record, SIZE, TRAP):
        records.write_timeout_record(record, sptrs, cell, me, e, SIZE)
        if TRAP:
            core.trap()


@triton.jit
def wait(sptrs, cell, me, epoch, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """Bounded wait until every member published ``epoch``; on failure the fence's record
    and a trap (GPU), as :func:`symmsync.language.wait_or_trap`. Returns True on success."""
    return ssl.wait_or_trap(sptrs, cell, me, epoch, timeout_ns, record, SIZE, TRAP) == 0


@triton.jit
def grid_barrier(counter, target, epoch, timeout_ns, mism, me, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """Wait until ``target`` programs of this launch arrived at ``counter`` (bounded).

    Needs every program of the launch resident at once (see the module). Run between a
    launch's two phases, so that no program's second arrival is counted as a first.
    On a timeout it writes a ``GRID_STALL`` record and traps (GPU). Returns True on success.
    """
    status, n = core.bounded_poll(counter, target, counter, 0, me, timeout_ns, SIZE, core.COUNTER, core.GE)
    if status != 0:
        records.write_grid_stall_record(mism, me, epoch, n, SIZE, TRAP)
    return status == 0
