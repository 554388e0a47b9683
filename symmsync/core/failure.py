"""The failure of a peer view: one owner for this rank's abort and for every waiter's error.

Each :class:`~symmsync.PeerView` has one :class:`ViewFailure`, ``view.failure``. It holds
the reason this rank aborted the view with, the objects that wait on the view's members
(its :class:`Waiter` s: every :class:`~symmsync.Fence`, :class:`~symmsync.Signals` and
collective (:mod:`symmsync.collectives`) made on the view registers), the error each of
them failed with, and the marking kernel that tells the members. Nothing else writes that
state; a waiter asks before it runs and reports what it saw::

    view.failure.register(fence, "channel 0")           # at construction
    view.failure.check(fence)                           # before an operation: may it run?
    view.failure.settle(fence, fence.timeout_error)     # after launches: raise what its record holds
    view.failure.fail(fence, err)                       # its wait failed: err is its error now
    view.failure.abort(reason)                          # PeerView.abort, Fence.abort

The states, and what moves between them:

* The view is *open* until this rank aborts it, then *aborted* with the first reason, for
  good. :meth:`ViewFailure.abort` (from :meth:`~symmsync.PeerView.abort` and
  :meth:`~symmsync.Fence.abort`) sets the reason, fails every waiter that has not failed
  yet with its :meth:`Waiter.abort_error`, then marks the abort flags at every member
  (:func:`symmsync.language.mark_abort`). :meth:`~symmsync.SymmetricBuffer.close` aborts
  each view with the reason ``"closed"`` through :meth:`ViewFailure.abort_quietly`, which
  aborts the view even when the marking cannot be sent. A view whose members span nodes
  (:attr:`PeerView.nodes <symmsync.PeerView.nodes>`) has no fences to mark: its abort is
  posted in the torch.distributed store instead (:func:`symmsync.spanning.exchange.post_abort`, which
  the off-node layer registers here: :func:`on_spanning_abort`), where the members of other
  nodes waiting in an :class:`~symmsync.spanning.exchange.OffNode` exchange read it.
* A waiter is *usable* until it *fails*, then it stays failed. It fails when it reports
  an error of its own (:meth:`ViewFailure.fail`, a later report replacing an earlier
  one), when the view is aborted, or at once when it registers on an aborted view.
* :meth:`ViewFailure.check` answers "may it run?": a usable waiter runs; a failed one
  raises its error, and when the call is an operation and the view is still open, the
  view is aborted first with the reason ``"rank R: <error type> on <where>"``, so the
  members stop waiting for this rank. So a failed waiter aborts the view at most once.
* :meth:`ViewFailure.settle` is how a waiter's own failure is found, the one path for
  every kind of waiter: wait for the device where launches are asynchronous (GPUs), read
  the waiter's record through the reader it passes, report the error it holds
  (:meth:`ViewFailure.fail`) and raise it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import triton
import triton.language as tl

from .. import language as ssl
from ..errors import CLOSED_REASON, ClosedError, PeerAborted
from ..language import cells
from . import liveness


class Waiter(Protocol):
    """What registers with a :class:`ViewFailure`: an object whose operations wait for the
    view's members (a :class:`~symmsync.Fence`, a :class:`~symmsync.Signals` object, a
    collective of :mod:`symmsync.collectives`), so that it has to
    fail closed once this rank gave up on the view. The owner holds it weakly, by identity:
    any plain class will do (one that defines ``__eq__`` must keep a ``__hash__``)."""

    def abort_error(self, reason: str) -> Exception:
        """The error its operations raise once this rank aborted the view with ``reason``."""
        ...

    def release_tables(self) -> None:
        """Optional: drop the buffer's tables it holds (its kernel arguments, bound launches),
        called when the buffer closes, so that only what users kept holds the mappings."""
        ...

    def refuse_kernel_args(self, reason: str) -> None:
        """Optional: make kernel arguments kept by users fail closed from now on (this rank
        aborted the view with ``reason``): a :class:`~symmsync.Signals` handle's state word."""
        ...


def used_after_abort(view: Any, what: str, reason: str, channel: int = -1) -> PeerAborted:
    """The :class:`~symmsync.PeerAborted` a waiter's calls raise once this rank aborted ``view``
    with ``reason``: the :meth:`Waiter.abort_error` of a fence, a :class:`~symmsync.Signals`
    object and a collective.

    Args:
        view: the aborted view.
        what: the waiter, as the message names it (``"fence"``, ``"Signals"``, ``"AllReduce"``).
        reason: the reason this rank aborted the view with.
        channel: the waiter's fence channel (-1: none).
    """
    return peer_aborted(
        view, view.rank, what, f"used after this rank aborted the view ({reason})", {view.rank: reason}, channel
    )


def peer_aborted(
    view: Any, rank: int, what: str, happened: str, aborted: dict[int, str], channel: int = -1
) -> PeerAborted:
    """The one wording of a :class:`~symmsync.PeerAborted` raised on the host, outside a fence's
    record: a waiter used after this rank's abort (:func:`used_after_abort`), an exchange between
    nodes that members gave up on or that broke (:mod:`symmsync.spanning.exchange`).

    Args:
        view: the view it happened on.
        rank: this rank, as the message names it (the exchange names global ranks).
        what: the waiter or call (``"fence"``, ``"OffNode.all_gather"``).
        happened: what happened, naming who gave up and why.
        aborted: ``{rank: reason}`` of those named (:attr:`~symmsync.PeerAborted.aborted`).
        channel: the waiter's fence channel (-1: none).
    """
    on = f" channel {channel}" if channel >= 0 else ""
    return PeerAborted(
        f"rank {rank}: {what} on view {list(view.ranks)}{on}: {happened}; it fails closed from now on (carry on "
        "with a new view)",
        rank=rank,
        epoch=-1,
        late={},
        channel=channel,
        aborted=aborted,
    )


@dataclass(frozen=True, slots=True)
class Stall:
    """How :meth:`ViewFailure.settle` waits for a device that may never come back: where
    ranks share one GPU, a trap in one rank's CUDA context has left another rank's
    ``torch.cuda.synchronize()`` blocked for good (docs/gpu.md). The device is then waited
    for in a thread of its own while the record is read every 2 ms: the record's error
    is raised as soon as it holds one, and ``error()`` once ``after_s`` seconds passed
    with neither the device done nor an error recorded.

    Attributes:
        after_s: how long to wait for the device or a recorded error.
        error: makes the error to raise then (it says why the device may be stuck).
    """

    after_s: float
    error: Callable[[], Exception]


def _synchronize(device: torch.device, read_error: Callable[[], Exception | None], stall: Stall) -> Exception | None:
    """``torch.cuda.synchronize(device)`` under ``stall``: ``None`` once the device is done,
    else the error to raise (the record's, or the stall's); the device's own error is raised."""
    done = threading.Event()
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            torch.cuda.synchronize(device)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            raised.append(e)
        finally:
            done.set()

    threading.Thread(target=wait, name="symmsync-synchronize", daemon=True).start()
    deadline = time.monotonic() + stall.after_s
    while not done.wait(0.002):
        err = read_error()  # the record's flag is written last: once it is seen, the record is complete
        if err is not None:
            return err
        if time.monotonic() > deadline:
            return stall.error()
    if raised:
        raise raised[0]
    return None


@dataclass(slots=True)
class _Entry:
    where: str  # what the waiter is, in an abort reason: "channel 0"
    error: Exception | None = None


#: What an abort of a view that spans nodes also does (:func:`on_spanning_abort`): ``None`` until
#: the off-node layer registers its post.
_spanning_abort: Callable[[Any, str], None] | None = None


def on_spanning_abort(post: Callable[[Any, str], None]) -> None:
    """Register ``post(view, reason)``, run by every abort of a view whose members span nodes
    (:mod:`symmsync.spanning.exchange` registers its post in the torch.distributed store, where the
    members of the other nodes read it: this module is below it and names it not)."""
    global _spanning_abort
    _spanning_abort = post


class ViewFailure:
    """This rank's abort of one view and the failures of the view's waiters (see the module).

    Attributes:
        clean: True while the view is open and none of its waiters failed: a waiter may then
            run without asking :meth:`check` (the fence's hot path reads only this).
    """

    def __init__(self, view: Any):
        self._view = view
        self._reason: str | None = None
        self._waiters: weakref.WeakKeyDictionary[Waiter, _Entry] = weakref.WeakKeyDictionary()
        self._warm = False  # the marking kernel is compiled (GPU)
        self.clean = True
        #: ``(rank, reason)`` of the member whose abort this rank's abort relays (it gave up on
        #: seeing that member's abort, or its death), else ``None``: set before the waiters are
        #: failed, so that the view over nodes above a node view relays the same origin.
        self.relayed: tuple[int, str] | None = None

    @property
    def reason(self) -> str | None:
        """The reason this rank aborted the view with, or ``None`` while it is open."""
        return self._reason

    # ------------------------------------------------------------------ waiters
    def register(self, waiter: Waiter, where: str) -> None:
        """Track ``waiter`` (held weakly): from now on it fails when the view is aborted, at
        once if it already is. ``where`` names it in the reason of an abort it causes
        (``"channel 0"``). The first waiter of a view on a GPU compiles the marking kernel,
        so that an abort costs a launch, not a compile."""
        entry = _Entry(where)
        if self._reason is not None:
            entry.error = waiter.abort_error(self._reason)
        self._waiters[waiter] = entry
        view = self._view
        if view.nodes.single and view.size > 1:  # a member that dies is named within a poll (core/liveness.py)
            processes = getattr(view.buffer, "_processes", None)
            if processes is not None:
                liveness.watch(view, [processes[r] for r in view.ranks])
        if not self._warm and self._view.buffer.capabilities.traps and self._view.nodes.single:
            self._warm = True
            self._warm_up()

    def fail(self, waiter: Waiter, error: Exception) -> None:
        """``waiter`` failed with ``error`` (a wait of its own timed out, or saw an abort):
        every later :meth:`check` of it raises ``error``."""
        self._waiters[waiter].error = error
        self.clean = False

    def error_of(self, waiter: Waiter) -> Exception | None:
        """The error ``waiter`` failed with (its own, or the view's abort), or ``None`` while it is usable."""
        entry = self._waiters.get(waiter)
        return None if entry is None else entry.error

    def check(self, waiter: Waiter, operation: bool = True) -> None:
        """Return if ``waiter`` may run; raise its error if it failed.

        Args:
            waiter: a registered waiter.
            operation: the call takes part in a step with the members (a fence, a wait):
                if ``waiter`` failed and the view is still open, abort the view first, so
                the members do not wait for this rank until their budget runs out. False
                for a call that only reads this rank's state (``Fence.epoch``).
        """
        entry = self._waiters[waiter]
        if entry.error is None:
            return
        if operation and self._reason is None:
            err = entry.error
            self.abort_quietly(f"rank {self._view.rank}: {type(err).__name__} on {entry.where}", cause=err)
        raise entry.error

    def settle(
        self,
        waiter: Waiter,
        read_error: Callable[[], Exception | None],
        synchronize: bool = True,
        stall: Stall | None = None,
    ) -> None:
        """Raise the error ``waiter``'s record holds, after reporting it (:meth:`fail`).

        The one "synchronize, read the record, report, raise" of every waiter: each supplies
        only ``read_error``, which reads its record and returns the error it describes, or
        ``None`` while it holds none.

        Args:
            waiter: a registered waiter.
            read_error: reads ``waiter``'s record (``Fence.timeout_error``).
            synchronize: wait for the device first where launches are asynchronous (GPUs),
                so that the record is complete; a failed wait traps there, and the device
                error it leaves is raised as the record's error (chained to it), or as is
                when the record holds none (the trap was not this waiter's). False reads the
                record as it is now (the host backend's launches have finished already).
            stall: where the device may never come back (ranks sharing a GPU): wait for it
                in a thread and raise the record's error as soon as it holds one
                (:class:`Stall`); ``None`` waits in this thread.
        """
        buf = self._view.buffer
        if synchronize and buf.capabilities.streams:
            try:
                early = None
                if stall is None:
                    torch.cuda.synchronize(buf.device)
                else:
                    early = _synchronize(buf.device, read_error, stall)
            except RuntimeError as e:
                err = read_error()
                if err is None:
                    raise
                self.fail(waiter, err)
                raise err from e
            if early is not None:
                self.fail(waiter, early)
                raise early
        err = read_error()
        if err is not None:
            self.fail(waiter, err)
            raise err

    def release_tables(self) -> None:
        """The buffer closed: every waiter that holds its tables drops them (:meth:`Waiter.release_tables`)."""
        for waiter in list(self._waiters):
            release = getattr(waiter, "release_tables", None)
            if release is not None:
                release()

    # ------------------------------------------------------------------ abort
    def abort(self, reason: str, cause: Exception | None = None) -> None:
        """Abort the view: fail every waiter, then mark this rank's abort flag at every member.

        Idempotent: only the first reason counts, and after ``close()`` (which aborted the
        view with ``"closed"``) it does nothing. :meth:`~symmsync.PeerView.abort` gives the contract.

        Args:
            reason: why, as this rank's own errors say it.
            cause: the error that made this rank give up, if any. When it is a
                :class:`~symmsync.PeerAborted` naming another member (this rank saw that
                member's abort), this abort only relays it: the members read the origin's rank
                and reason in this rank's cell (:data:`symmsync.language.cells.REASON_RELAYED`),
                so that every member's error names the origin, whichever flag its wait saw first.

        Raises:
            ClosedError: the buffer was closed without aborting the view first.
        """
        if self._reason is not None:
            return
        view = self._view
        if view.buffer.closed:
            raise ClosedError(f"rank {view.rank}: PeerView.abort used after its buffer was closed")
        origin = self.relayed = _origin(cause, view.rank)
        self._set(reason)
        if origin is not None:
            self._mark(cells.REASON_RELAYED + origin[0], origin[1])
        else:
            self._mark(cells.REASON_CLOSED if reason == CLOSED_REASON else cells.REASON_ERROR, reason)

    def abort_quietly(self, reason: str, cause: Exception | None = None) -> None:
        """:meth:`abort`, for an error path or ``close()``: the flags are a courtesy to the
        members, and a failure to send them (a CUDA context that a trap made unusable) must
        not hide the error being raised; the view is aborted here all the same, and the
        members fall back to their budget."""
        try:
            self.abort(reason, cause)
        except Exception:  # noqa: BLE001
            if self._reason is None:
                self._set(reason)

    def _set(self, reason: str) -> None:
        self._reason = reason
        self.clean = False
        if not self._view.nodes.single and _spanning_abort is not None:  # the other nodes read it there
            _spanning_abort(self._view, reason)
        for waiter, entry in list(self._waiters.items()):
            if entry.error is None:
                entry.error = waiter.abort_error(reason)
            refuse = getattr(waiter, "refuse_kernel_args", None)
            if refuse is not None:
                refuse(reason)

    def _mark(self, code: int, text: str) -> None:
        # One launch per channel: every channel's fences wait in their own cell. Where launches
        # are asynchronous (GPUs) on a stream of its own, since the current stream may hold a
        # fence that waits; it returns once the flags are sent.
        view = self._view
        if not view.nodes.single:  # no fence waits on a spanning view's cells (core/fence.py refuses one)
            return
        buf = view.buffer
        offsets = [view.cell_offset(c) for c in range(buf.cells.channels)]
        ptrs, me = view.cell_ptrs, view.local_index
        words = cells.encode_reason(code, text)
        if not buf.capabilities.streams:
            reason = torch.tensor(words, dtype=torch.int64)
            for cell in offsets:
                _abort_kernel[(1,)](ptrs, cell, me, reason, SIZE=view.size, num_warps=1)
            return
        with torch.cuda.device(buf.device):
            side = torch.cuda.Stream(buf.device)
            with torch.cuda.stream(side):
                reason = torch.tensor(words, dtype=torch.int64, device=buf.device)
                for cell in offsets:
                    _abort_kernel[(1,)](ptrs, cell, me, reason, SIZE=view.size, num_warps=1)
            side.synchronize()

    def _warm_up(self) -> None:
        view = self._view
        try:
            with torch.cuda.device(view.buffer.device):
                reason = torch.zeros(cells.REASON_WORDS, dtype=torch.int64, device=view.buffer.device)
                for c in range(view.buffer.cells.channels):
                    _abort_kernel.warmup(
                        view.cell_ptrs,
                        view.cell_offset(c),
                        view.local_index,
                        reason,
                        SIZE=view.size,
                        num_warps=1,
                        grid=(1,),
                    )
        except Exception:  # noqa: BLE001 - an optimization only: the abort compiles when it runs
            pass


def _origin(cause: Exception | None, rank: int) -> tuple[int, str] | None:
    """``(origin's global rank, its reason)`` when ``cause`` is a :class:`~symmsync.PeerAborted`
    naming a member other than ``rank`` (whose abort this rank relays), else ``None``."""
    if not isinstance(cause, PeerAborted):
        return None
    return next(((r, why) for r, why in cause.aborted.items() if r != rank), None)


@triton.jit
def _abort_kernel(ptrs, cell, me, reason, SIZE: tl.constexpr):
    ssl.mark_abort(ptrs, cell, me, reason, SIZE)
