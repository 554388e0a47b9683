"""Signals: per-peer int64 slots that kernels signal and wait on, point to point.

A :class:`Signals` object is made collectively from a peer view. It gives each member
``slots`` int64 slots per peer in memory of its own (a small symmsync buffer made over the
view's buffer group, apart from every fence cell and from the user region), a
device-resident base per (peer, slot) that makes counted waits replay safe, and a timeout
record. Kernels take :attr:`Signals.kernel_args` and call the signal primitives of
:mod:`symmsync.language`: :func:`~symmsync.language.signal` (ADD or SET, release at system
scope), :func:`~symmsync.language.wait_signal` (EQ, NE, GE, GT, LE, LT; acquire at system
scope), :func:`~symmsync.language.wait_count` (counters, replay safe),
:func:`~symmsync.language.read_signal` and :func:`~symmsync.language.put_signal`
(a tile store and its signal).

Every wait is bounded by :attr:`Signals.timeout_s` on the clock of a fence's wait. A wait
that times out or sees an abort fails closed: nothing after it may read peer data. It writes
a record naming this rank, the peer, the slot, the value and comparison awaited and the
value observed; on GPUs it traps. The contract is :mod:`symmsync.language`'s (the signals'
block of its module docstring; the layout of the handle and the slots is
:mod:`symmsync.language.cells`'s). :meth:`Signals.check` (host backend, after
each launch) and :meth:`Signals.synchronize` (GPUs) raise :class:`~symmsync.SignalTimeout`
from it. A member's abort (its ``close()``, an error, :meth:`~symmsync.PeerView.abort`) ends
every signal wait on the view within a poll, with :class:`~symmsync.SignalAborted` naming it:
the waits read the abort flags that the view's abort sets in its cells.

Every primitive checks its indices (me, peer, slot) on every call and raises
:class:`~symmsync.IndexCheckError` (GPUs: records it and traps; :meth:`Signals.check` and
:meth:`Signals.synchronize` raise it from the record). Through kernel arguments kept past
:meth:`Signals.close`, the buffer's ``close()`` or this rank's abort, every wait fails at
once and nothing is stored (the handle's state word).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import backends
from .. import language as ssl
from ..checks import check_index, int_problem, is_int, require, timeout_problem
from ..errors import (
    CLOSED_REASON,
    BoundsError,
    ClosedError,
    ConfigError,
    PeerAborted,
    SignalAborted,
    SignalTimeout,
    SymmSyncError,
)
from ..language import cells, records
from .agreement import Same, agree, barrier
from .failure import used_after_abort
from .memory import keep_alive
from .nodes import spanning_problem
from .views import PeerView

#: Most slots per peer a Signals object holds.
MAX_SLOTS = 4096

log = logging.getLogger(__name__)

_OPS = {"add": 0, "set": 1}
_INT64 = (-(2**63), 2**63 - 1)


@triton.jit
def _signal_kernel(sig, me, peer, slot, value, OP: tl.constexpr, NSLOTS: tl.constexpr):
    ssl.signal(sig, me, peer, slot, value, OP, NSLOTS)


@triton.jit
def _wait_kernel(
    sig,
    me,
    timeout_ns,
    record,
    peer,
    slot,
    value,
    CMP: tl.constexpr,
    COUNTED: tl.constexpr,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    if COUNTED:
        ssl.wait_count(sig, me, peer, slot, value, timeout_ns, record, SIZE, NSLOTS, TRAP)
    else:
        ssl.wait_signal(sig, me, peer, slot, value, CMP, timeout_ns, record, SIZE, NSLOTS, TRAP)


def _aborted_by(aborter: int, reason: str, message: str) -> PeerAborted:
    """The refusal every rank raises when rank ``aborter`` had aborted the view (``reason``)
    before making its Signals: a :class:`~symmsync.PeerAborted` of the raising rank (its
    ``rank``, as for every wait's error) naming the aborter. Picklable as a partial: it
    travels in the constructor's exchange."""
    return PeerAborted(message, rank=dist.get_rank(), epoch=-1, late={}, channel=-1, aborted={aborter: reason})


class Signals:
    """Point-to-point signal slots among the members of a peer view (collective).

    Args:
        view: this rank's :class:`~symmsync.PeerView`. Every rank of the view's buffer group
            constructs its Signals at the same point, each from its own view (as views are
            made), with the same ``slots`` and ``timeout_s``.
        slots: int64 slots per peer (1..MAX_SLOTS). Member ``p``'s slot ``s`` at this rank
            counts (or holds) what ``p`` signalled on ``s``.
        timeout_s: wait budget in seconds (default: the buffer's ``default_timeout_s``, as
            for a :class:`~symmsync.Fence`).

    Raises:
        ConfigError: a bad argument on any rank, or ranks that disagree (raised on every
            rank); the object made while a CUDA graph is being captured (create it before
            capture).
        ClosedError: the view's buffer is closed (raised on every rank).
        PeerAborted: this rank aborted the view (raised on every rank).

    Example::

        sigs = ss.Signals(view, slots=4)
        my_kernel[(1,)](*sigs.kernel_args, ..., **sigs.constexprs)
        sigs.check()
    """

    def __init__(self, view: PeerView, slots: int = 1, *, timeout_s: float | None = None):
        backends.refuse_compiling("Signals")
        good_view = isinstance(view, PeerView)
        group = view.buffer.group if good_view else dist.group.WORLD
        problem, error = None, ConfigError
        if not good_view:
            problem = f"view must be a PeerView, got {type(view).__name__}"
        elif view.buffer.closed:
            problem, error = "the view's buffer is closed", ClosedError
        elif view.aborted is not None:
            problem = f"this rank aborted the view ({view.aborted})"
            error = functools.partial(_aborted_by, view.buffer.rank, view.aborted)
        else:
            problem = spanning_problem(view.nodes, "Signals")
        problem = problem or int_problem("slots", slots, minimum=1, maximum=MAX_SLOTS)
        if problem is None and timeout_s is not None:
            problem = timeout_problem(timeout_s)
        everyone = agree(
            group,
            "Signals",
            {"slots": slots, "timeout_s": timeout_s, "size": view.size if good_view else 0},
            problem=problem,
            error=error,
            same={"slots": Same(), "timeout_s": Same()},
            device=view.buffer.device if good_view else None,
        )

        buf = view.buffer
        caps = buf.capabilities
        self.view = view
        self.size = view.size
        """Members of the view (the kernels' ``SIZE``)."""
        self.slots = slots
        """Slots per peer (the kernels' ``NSLOTS``)."""
        self.timeout_s = float(caps.default_timeout_s if timeout_s is None else timeout_s)
        self.timeout_ns = int(self.timeout_s * 1e9)
        """Wait budget in ns (kernel argument)."""
        self.traps = caps.traps
        """Whether a failed wait traps (the kernels' ``TRAP``): on GPUs."""
        self._caps = caps
        from .buffer import SymmetricBuffer  # the buffer module imports views, which this module needs first

        nbytes = max(cells.signal_memory_bytes(e["size"], slots) for e in everyone)
        self._memory = SymmetricBuffer(
            nbytes, group=group, device=buf.device, backend=buf.backend, max_views=1, channels=1
        )
        mem = self._memory
        mem.local_memory()[:nbytes].zero_()  # CUDA memory starts undefined; nobody signals before the barrier
        if caps.streams:
            torch.cuda.synchronize(buf.device)
        members = list(view.ranks)
        # The members' slot memory: the view's entries of the allocation's own table, as a view
        # takes its entries of the buffer's (core/views.py). Its group is the buffer's, which may
        # span nodes; the view's members are on this rank's node (refused above otherwise), so
        # each entry names mapped memory (mem.ptrs refuses the whole table of a spanning group).
        table = mem._ptrs
        inbox = table.cpu()[members]
        data = view.ptrs.cpu()
        cell = view.cell_ptrs.cpu() + view.cell_offset(0)
        self._record = torch.zeros(records.SIGNAL_RECORD_WORDS, dtype=torch.int64, pin_memory=caps.pinned_record)
        header = [0] * cells.HANDLE_INBOX
        header[cells.HANDLE_NBYTES] = buf.nbytes
        header[cells.HANDLE_RANK] = buf.rank
        header[cells.HANDLE_SIZE] = self.size
        header[cells.HANDLE_SLOTS] = slots
        header[cells.HANDLE_BASES] = int(inbox[view.local_index]) + cells.inbox_bytes(self.size, slots)
        header[cells.HANDLE_RECORD] = self._record.data_ptr()
        header[cells.HANDLE_STATE] = 0  # usable: _refuse_kernel_args sets it
        handle = torch.tensor(header, dtype=torch.int64)
        self._handle = torch.cat([handle, inbox, data, cell]).to(buf.device)
        self._state = 0  # the handle's state word, as last set from here
        assert self._handle.numel() == cells.handle_words(self.size)
        # The handle names the slots' memory, the view's user regions and cells, and the
        # record: a kernel launched through kernel_args kept past close() finds them all
        # still mapped (as tensors kept past close() do), never freed memory.
        keep_alive(self._handle, table, view.ptrs, view.cell_ptrs, self._record)
        self.record = self._record.data_ptr()
        """Address of the timeout record (kernel argument; pinned host memory on GPUs)."""
        self._kernel_args = (self._handle, view.local_index, self.timeout_ns, self.record)
        # The view's failure owner fails this object when the view is aborted, and keeps the
        # error of a wait of its own that failed (check(), synchronize()).
        view.failure.register(self, "signals")
        barrier(group)

    # ------------------------------------------------------------------ kernel inputs
    @property
    def kernel_args(self) -> tuple[torch.Tensor, int, int, int]:
        """What a kernel takes: ``(sig, me, timeout_ns, record)``.

        ``sig`` is the handle (an int64 tensor on the buffer's device: the members' slot
        arrays, their user-region bases, their abort cells; ``symmsync.language.cells`` has its
        layout), ``me`` this rank's index in the view, ``timeout_ns`` the wait budget,
        ``record`` the timeout record's address. Pass them first and :attr:`constexprs`
        by name::

            kernel[grid](*sigs.kernel_args, ..., **sigs.constexprs)

        Raises :class:`~symmsync.PeerAborted` once this rank aborted the view, and this
        rank's earlier signal error after one. Arguments kept past :meth:`close`, the
        buffer's ``close()`` or this rank's abort stay safe to launch and fail closed: the
        handle's state word makes every wait through them return 2 at its first poll and
        every signal store nothing (docs/signals.md, "Fail closed").
        """
        self._check_usable()
        return self._kernel_args

    @property
    def constexprs(self) -> dict[str, Any]:
        """The compile-time constants of the signal primitives: ``SIZE``, ``NSLOTS``, ``TRAP``."""
        return {"SIZE": self.size, "NSLOTS": self.slots, "TRAP": self.traps}

    @property
    def handle(self) -> torch.Tensor:
        """The handle alone (``kernel_args[0]``)."""
        return self.kernel_args[0]

    # ------------------------------------------------------------------ host side
    def signal(self, peer: int, slot: int, value: int = 1, op: str = "add") -> None:
        """Launch one :func:`~symmsync.language.signal` on the current stream: add ``value``
        to (``op="add"``), or store it in (``"set"``), the slot this rank has at member
        ``peer`` (a view index). Released after everything earlier on the stream."""
        self._check_usable()
        call = "Signals.signal"
        peer, slot = self._target(peer, slot, call)
        if op not in _OPS:
            require(f"op must be 'add' or 'set', got {op!r}", rank=self.view.rank, call=call)
        self._int64(value, "value", call)
        _signal_kernel[(1,)](self._handle, self.view.local_index, peer, slot, value, OP=_OPS[op], NSLOTS=self.slots)

    def wait(self, peer: int, slot: int, value: int, cmp: str = "GE") -> None:
        """Launch one :func:`~symmsync.language.wait_signal` on the current stream: wait until
        the slot member ``peer`` signals this rank on compares ``cmp`` (``"EQ"`` ... ``"LT"``)
        to ``value``. Raises as :meth:`check` on the host backend (GPUs: at :meth:`synchronize`)."""
        self._wait(peer, slot, value, cmp, False, "Signals.wait")

    def wait_count(self, peer: int, slot: int, count: int = 1) -> None:
        """Launch one :func:`~symmsync.language.wait_count`: wait for ``count`` more signals
        from member ``peer`` on ``slot`` than counted waits consumed, then consume them."""
        self._wait(peer, slot, count, "GE", True, "Signals.wait_count")

    def _wait(self, peer: Any, slot: Any, value: Any, cmp: Any, counted: bool, call: str) -> None:
        self._check_usable()
        peer, slot = self._target(peer, slot, call)
        if cmp not in cells.CMP_NAMES:
            require(f"cmp must be one of {', '.join(cells.CMP_NAMES)}, got {cmp!r}", rank=self.view.rank, call=call)
        self._int64(value, "count" if counted else "value", call, minimum=0 if counted else None)
        _wait_kernel[(1,)](
            *self._kernel_args,
            peer,
            slot,
            value,
            CMP=cells.CMP_NAMES.index(cmp),
            COUNTED=counted,
            **self.constexprs,
        )
        if self._caps.host_checks_status:
            self.check()

    def _target(self, peer: Any, slot: Any, call: str) -> tuple[int, int]:
        me = self.view.rank
        check_index("peer", peer, self.size, "the view's members", rank=me, call=call)
        check_index("slot", slot, self.slots, "the Signals object's slots", rank=me, call=call)
        return peer, slot

    def _int64(self, v: Any, name: str, call: str, minimum: int | None = None) -> None:
        if not is_int(v):
            require(f"{name} must be an int, got {v!r}", rank=self.view.rank, call=call)
        lo = _INT64[0] if minimum is None else minimum
        if not lo <= v <= _INT64[1]:
            require(
                f"{name} {v} does not fit the slot (int64, from {lo} to {_INT64[1]})",
                rank=self.view.rank,
                call=call,
                error=BoundsError,
            )

    def values(self) -> torch.Tensor:
        """A copy of this rank's slots, ``[size, slots]`` int64: row ``p`` is what member ``p``
        signalled here. (On GPUs it synchronizes the device first.)"""
        return self._array(0)

    def consumed(self) -> torch.Tensor:
        """A copy of this rank's bases, ``[size, slots]``: what its counted waits consumed."""
        return self._array(cells.inbox_bytes(self.size, self.slots))

    def _array(self, start: int) -> torch.Tensor:
        self._check_open()
        if self._caps.streams:
            torch.cuda.synchronize(self.view.buffer.device)
        n = self.size * self.slots * 8
        raw = self._memory.local_memory()[start : start + n]
        return raw.view(torch.int64).view(self.size, self.slots).clone().cpu()

    def check(self) -> None:
        """Raise :class:`~symmsync.SignalTimeout` (or :class:`~symmsync.SignalAborted`) if a
        wait failed; after each launch on the host backend, or use :meth:`synchronize`."""
        self._check_usable()
        self.view.failure.settle(self, self.timeout_error, synchronize=False)

    def synchronize(self) -> None:
        """Wait for the device; turn a trapped signal wait into :class:`~symmsync.SignalTimeout`."""
        self._check_usable()
        self.view.failure.settle(self, self.timeout_error)

    def timeout_error(self) -> SymmSyncError | None:
        """The error this object's record describes, if a wait failed or a primitive was
        misused (else ``None``): :class:`~symmsync.SignalTimeout`,
        :class:`~symmsync.SignalAborted`, :class:`~symmsync.IndexCheckError` or
        :class:`~symmsync.ClosedError`."""
        words = self._record.tolist()
        misuse = records.read_misuse_record(words)
        if misuse is not None:
            return records.misuse_error(misuse, self.view.rank, "Signals")
        rec = records.read_signal_record(words)
        if rec is None:
            return None
        ranks = self.view.ranks
        me, peer = ranks[rec.index], ranks[rec.peer]
        cmp = cells.CMP_NAMES[rec.cmp]
        if rec.counted:
            want = (
                f"{rec.value} more signal(s) from rank {peer} on slot {rec.slot} (the slot at >= "
                f"{rec.base + rec.value}: {rec.base} consumed before)"
            )
        else:
            want = f"rank {peer}'s slot {rec.slot} {cells.CMP_SYMBOLS[rec.cmp]} {rec.value} ({cmp})"
        where = f"rank {me}: signal wait on view {list(ranks)}"
        fields = dict(
            rank=me, peer=peer, slot=rec.slot, cmp=cmp, observed=rec.observed, base=rec.base, counted=rec.counted
        )
        if rec.aborted and rec.aborter == rec.index:  # through a handle that was closed or aborted
            why = cells.decode_reason(rec.reason, closed=CLOSED_REASON)
            what = "closed" if why == CLOSED_REASON else f"aborted by this rank ({why})"
            msg = (
                f"{where} waiting for {want} ran through kernel arguments kept past this rank's Signals "
                f"being {what}: it failed at once without reading the slot (a closed handle never passes a "
                "wait). Take kernel_args from a live Signals object."
            )
            return SignalAborted(msg, expected=rec.value, aborted={me: why}, **fields)
        if rec.aborted and rec.aborter >= 0:
            who = ranks[rec.aborter]
            why = cells.decode_reason(rec.reason, closed=CLOSED_REASON)
            what = "closed its buffer" if why == CLOSED_REASON else f"aborted: {why}"
            origin = cells.reason_origin(rec.reason)
            if origin is not None and origin != who:  # that member only relayed the origin's abort
                what += f" (relayed by rank {who})"
                who = origin
            msg = (
                f"{where} gave up waiting for {want}: rank {who} {what}; the slot holds {rec.observed}. "
                "Nothing after the wait ran (see that rank's log for the cause)."
            )
            return SignalAborted(msg, expected=rec.value, aborted={who: why}, **fields)
        msg = (
            f"{where} timed out after {self.timeout_s:g} s waiting for {want}; the slot holds {rec.observed}. "
            f"Rank {peer} never signalled it (crashed, hung, took another path, or signalled another slot); "
            "nothing after the wait ran."
        )
        return SignalTimeout(msg, expected=rec.value, **fields)

    def release_tables(self) -> None:
        """The view's buffer closed: drop the tables this object holds (the buffer's ``close()``
        calls it through the view's failure owner); only a kept ``kernel_args`` holds them now,
        and its handle says closed (:meth:`refuse_kernel_args`)."""
        self.refuse_kernel_args(CLOSED_REASON)
        self._kernel_args = None

    def refuse_kernel_args(self, reason: str) -> None:
        """Make the handle refuse every wait and signal from now on: set its state word to
        closed (``reason`` ``"closed"``) or aborted (any other reason), in stream order.

        Called by :meth:`close`, by the buffer's ``close()`` and by this rank's abort of the
        view (through the view's failure owner, :class:`symmsync.core.failure.ViewFailure`), so that
        a kernel launched through ``kernel_args`` kept past them fails at its first poll
        (status 2, recorded) and stores nothing, whatever the slots hold. Best effort: a CUDA
        context that a trap made unusable takes no store, and runs nothing either.
        """
        code = cells.REASON_CLOSED if reason == CLOSED_REASON else cells.REASON_ERROR
        if self._state == cells.REASON_CLOSED:  # closed is final; a later abort does not undo it
            return
        self._state = code
        try:
            self._handle[cells.HANDLE_STATE].fill_(code)  # a device tensor on GPUs: stream ordered
        except Exception as e:  # noqa: BLE001 - close() and abort must not raise for it
            log.warning("Signals: could not mark the handle %s: %s", reason, e)

    def abort_error(self, reason: str) -> PeerAborted:
        """The error every host call raises once this rank aborted the view with ``reason``
        (asked by the view's failure owner, :class:`symmsync.core.failure.ViewFailure`)."""
        return used_after_abort(self.view, "Signals", reason)

    def _check_open(self) -> None:
        if self.view.buffer.closed or self._memory.closed:
            raise ClosedError(f"rank {self.view.rank}: Signals used after its buffer was closed (or close())")

    def _check_usable(self) -> None:
        self._check_open()
        failure = self.view.failure
        if not failure.clean:
            failure.check(self)

    def close(self) -> None:
        """Release the slots' memory on this rank (idempotent; needs no other rank).

        A member still waiting on a slot this rank would signal runs into its budget,
        unless the view is aborted too (``close()`` of the view's buffer does that).
        ``kernel_args`` kept past it stay safe to launch and fail closed: every wait through
        them returns 2 at its first poll, and signal and put_signal store nothing (the handle's
        state word, :meth:`refuse_kernel_args`)."""
        if not self._memory.closed:
            self.refuse_kernel_args(CLOSED_REASON)
        self._memory.close()

    def __repr__(self) -> str:
        return f"Signals(view={list(self.view.ranks)}, slots={self.slots}, backend={self.view.buffer.backend})"
