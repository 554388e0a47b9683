"""How the members of a collective hand their slots to each other: the one place of its synchronization.

Everything the collectives' kernels need to order their memory lives here, built on the
primitives of :mod:`symmsync.language` and the view's fence cell (its device-resident
epoch). Replacing these few functions (with per-peer signals, for example) changes the
protocol of every operation at once. The steps are symmsync's own, written once for the
fences and the collectives: :func:`arrive` is :func:`symmsync.language.core.arrive` (with
a counter of the collective's own), :func:`grid_barrier` polls with
:func:`symmsync.language.core.bounded_poll`, and the records (a mismatch, a stalled grid)
are :mod:`symmsync.language.records`'.

Pseudocode of one call, as every member runs it (``G`` programs, the epoch on the device)::

    e = epoch + 1;  q = e % 2                      # parity of this call's slots (device-side)
    if closed(e): fail_closed(e); return           # a launch kept past close(): fails at once, publishes nothing
    copy x into input[q] (unless the caller filled the symmetric input in place)
    program 0: header[q] = (op, numel, dtype, algorithm, symmetric, e, epilogue)
    arrive(): the last program of the launch publishes e      [release, system scope]
    wait(e): every member published e                         [acquire, system scope]
    if a member's header[q] is refused (numel < 0: its input failed its checks, refused_seen()):
        record it (no trap), reset the arrival counter; read nothing, publish nothing more
    read the members' input[q] (sum in member order in float32, or copy), storing only
        if every member's header[q] is this call's; else record, trap (GPU) / report (host)
    two-shot / symmetric input: grid_barrier(); arrive(): publish e + 1; wait(e + 1)

A refused call: the member whose input failed its checks still makes the call, launching
with ``count = -1`` (it copies nothing, and its header says so); every member publishes ``e``
once, sees the refusal after its wait, and reads and stores nothing (a two-phase call skips
its second phase on every member alike), so that every member's epoch stays in step and the
next call goes on. The host raises :class:`~symmsync.InputError` on that member and
:class:`~symmsync.PeerRefused` on the others.

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

from . import layout as L

_CLOSED_EPOCH = tl.constexpr(CLOSED_EPOCH)
_HEADER_WORDS = tl.constexpr(L.HEADER_WORDS)
_HEADER_CHECKED = tl.constexpr(L.HEADER_CHECKED)
_H_TAG, _H_NUMEL, _H_DTYPE = tl.constexpr(L.H_TAG), tl.constexpr(L.H_NUMEL), tl.constexpr(L.H_DTYPE)
_H_ALGORITHM, _H_SYMMETRIC = tl.constexpr(L.H_ALGORITHM), tl.constexpr(L.H_SYMMETRIC)
_H_EPOCH, _H_EPILOGUE = tl.constexpr(L.H_EPOCH), tl.constexpr(L.H_EPILOGUE)


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


@triton.jit
def header_words(op, numel, dtype_code, algorithm, symmetric, epoch, epilogue):
    """The ``HEADER_WORDS`` words of a call's header, as a block (see :mod:`.layout`)."""
    w = tl.arange(0, _HEADER_WORDS)
    words = tl.where(w == _H_TAG, op, 0)
    words = tl.where(w == _H_NUMEL, numel, words)
    words = tl.where(w == _H_DTYPE, dtype_code, words)
    words = tl.where(w == _H_ALGORITHM, algorithm, words)
    words = tl.where(w == _H_SYMMETRIC, symmetric, words)
    words = tl.where(w == _H_EPOCH, epoch, words)
    words = tl.where(w == _H_EPILOGUE, epilogue, words)
    return words.to(tl.int64)


@triton.jit
def write_header(ptrs, header_off, me, words):
    """This member's header ``words`` at ``header_off`` in its own memory (one program, before it arrives)."""
    tl.store(ssl.peer_ptr(ptrs, me, header_off, tl.int64) + tl.arange(0, _HEADER_WORDS), words)


@triton.jit
def refused_seen(ptrs, header_off, me, mine, SIZE: tl.constexpr):
    """True when this call is refused: a member's header (this member's own ``mine`` too) has a
    negative ``numel``, which only a refused call writes (its member's input failed its checks:
    it launches with ``count = -1``, copies nothing and publishes once, as every member then does).
    Run after the wait, as :func:`headers_match`."""
    refused = tl.sum(tl.where(tl.arange(0, _HEADER_WORDS) == _H_NUMEL, mine, 0), axis=0) < 0
    for p in tl.static_range(SIZE):
        if p != me:
            refused = refused | (tl.load(ssl.peer_ptr(ptrs, p, header_off, tl.int64) + _H_NUMEL) < 0)
    return refused


@triton.jit
def headers_match(ptrs, header_off, me, mine, SIZE: tl.constexpr):
    """True when every other member's header for this call equals ``mine`` (this call's words).

    Run after the wait (the headers were published with the epoch). This member's own
    words come from its arguments, not from its memory: program 0 writes them, and
    another program of the launch may pass the wait before they land. Every member
    compares the same calls, so every member reaches the same verdict. Loads only, no
    branch: a kernel may issue its first payload loads before the verdict arrives and
    hold back its stores (:func:`symmsync.language.records.write_mismatch_record` after them).
    """
    w = tl.arange(0, _HEADER_WORDS)
    bad = 0
    for p in tl.static_range(SIZE):
        if p != me:
            theirs = tl.load(ssl.peer_ptr(ptrs, p, header_off, tl.int64) + w)
            bad += tl.sum(((theirs != mine) & (w < _HEADER_CHECKED)).to(tl.int32), axis=0)
    return bad == 0
