"""Agreement among the ranks of a group: how symmsync's constructors use the buffer's torch.distributed group.

Every collective entry point of symmsync (a buffer and its growth, a view, Signals, a
collective, the PCP writer, each mapping step) follows one protocol, written once in
:func:`agree`: each rank checks its own arguments into a problem (a sentence and the
error class it raises, or ``None``), one exchange carries every rank's problem and the
values the ranks must agree on, and then every rank raises the same error, or none
does. No rank is left waiting in a collective that another rank skipped::

    values = agree(group, "DirectKVWriter", {"route": route}, problem=problem, same={"route": Same()})

A peer that died or left makes the exchange fail on the others: they raise
:class:`~symmsync.BackendError` saying so, never torch.distributed's own error.

What maps memory runs as a :class:`Transaction`: all or nothing on every rank.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from .. import backends
from ..errors import BackendError, CaptureError, ConfigError, SymmSyncError

#: What makes the error every rank raises from its message: one of symmsync's error
#: classes, or any picklable callable (a rank's problem carries it through the exchange).
ErrorFactory = Callable[[str], SymmSyncError]


def gather(group: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in the group's rank order (collective)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:  # gloo/NCCL: a peer died or left the collective
        raise _lost_peer(group, e) from e
    return out


def barrier(group: Any) -> None:
    """Wait until every rank of ``group`` reached this point (collective)."""
    try:
        dist.barrier(group=group)
    except RuntimeError as e:
        raise _lost_peer(group, e) from e


def release_together(buf: Any, keys: Sequence[int], *, together: bool = True) -> None:
    """A consumer's ``close()``: give back its claims on ``buf`` (keys of ``buf.regions``) on every
    member at once (collective over the buffer's group, as the consumer's construction).

    Every member's calls on the bytes are over before any member's claim goes: this rank's
    device work first (GPUs: the device is synchronized; a device that a trap left unusable is
    passed over), then a barrier over the group. Once it returns, a new owner of the bytes on
    any member (a consumer of any layout, a user's claim, a plain store) cannot overwrite what a
    slow member still reads. The claims go even when the barrier fails (a member died: its
    :class:`~symmsync.BackendError` is raised after).

    Args:
        buf: the consumer's buffer (closed already: the claims go with no barrier).
        keys: what :meth:`~symmsync.core.regions.Regions.claim` returned for the consumer's claims.
        together: False gives the claims back on this rank only, with no barrier (a ``with``
            block left by an exception, which the other members may not have raised).
    """
    try:
        if together and not buf.closed:
            if buf.capabilities.streams:
                try:
                    torch.cuda.synchronize(buf.device)
                except RuntimeError as e:  # a trapped context: its kernels run no more
                    logging.getLogger("symmsync").warning("close(): the device could not be synchronized: %s", e)
            barrier(buf.group)
    finally:
        for key in keys:
            buf.regions.release(key)


def _lost_peer(group: Any, e: Exception) -> BackendError:
    return BackendError(
        f"rank {dist.get_rank(group)}: an exchange with the other ranks of the group failed: a rank "
        f"probably died or left the collective (check the other ranks' logs). torch.distributed: {e}"
    )


def plain(v: Any) -> Any:
    """``v`` if every rank can receive and compare it (tuples of such, too), else its repr
    (a junk argument must still reach the exchange, so that every rank raises instead of one)."""
    if isinstance(v, tuple):
        return tuple(plain(x) for x in v)
    return v if isinstance(v, (int, str, float, bool, type(None))) else repr(v)


def ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 3"`` or ``"ranks 1, 3"``."""
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def attempt(make: Callable[[], Any], rank: int) -> tuple[Any, str | None, ErrorFactory]:
    """Run a nested constructor (a ``Fence`` made inside a collective's constructor) as part
    of this rank's check, so that its refusal is agreed like any problem and every rank raises.

    Returns:
        ``(make(), None, ConfigError)``, or, when it raised a :class:`~symmsync.ConfigError`,
        ``(None, its message, its class)``: the message without the leading ``"rank R: "``
        (:func:`agree` names the rank itself).
    """
    try:
        return make(), None, ConfigError
    except ConfigError as e:
        return None, str(e).removeprefix(f"rank {rank}: "), type(e)


@dataclass(frozen=True)
class Same:
    """How :func:`agree` compares one field: the ranks that must pass it alike, and what
    every rank raises when they do not.

    Attributes:
        error: the error every rank raises (a mismatch of sizes is a
            :class:`~symmsync.SizeMismatchError`).
        hint: what to do, last in the message.
        among: the ranks (of the group) that must agree, such as a view's members, in
            the order the message names them; ``None``: every rank.
    """

    error: ErrorFactory = ConfigError
    hint: str = "pass the same on every rank"
    among: tuple[int, ...] | None = None


def agree(
    group: Any,
    call: str,
    values: Any = None,
    *,
    problem: str | None = None,
    error: ErrorFactory = ConfigError,
    same: Mapping[str, Same] | None = None,
    device: torch.device | None = None,
    failed: str = "",
    tail: str = "",
    received: Callable[[list[Any]], None] | None = None,
) -> list[Any]:
    """Agree on a collective call's arguments: the same outcome on every rank (collective).

    In order, on every rank alike:

    1. CUDA graph capture: where ``device``'s current stream is capturing on any rank,
       every rank raises :class:`~symmsync.CaptureError` naming those ranks (a call that
       allocates, maps or copies cannot be recorded). Where the exchange itself would
       run on the device (an NCCL group), the capturing rank raises it alone, before the
       exchange (ranks that capture the same code raise the same; one that did not
       capture waits in the exchange until the group's timeout, as for a rank that left).
    2. One exchange of every rank's ``(values, problem, error)``: a rank with a problem
       sends ``None`` for its values.
    3. ``received`` gets every rank's values, before a problem or a mismatch is raised.
    4. Problems: when any rank had one, every rank raises the error that the first such
       rank's problem carries, ``"{call}: {failed}rank R (and ranks S, T): {problem}{tail}"``.
    5. Each field of ``same``, in its order: unless the ranks of its ``among`` sent equal
       values (compared by repr), every rank raises ``"{call}: {field} differs across
       ranks (rank 0: v, rank 1: w); {hint}"``. Only the ranks in ``among`` are compared:
       a rank outside them sees the exchange and compares its own subset.

    Args:
        group: the process group.
        call: the public call it serves, first in every message (``"SymmetricBuffer.grow"``).
        values: this rank's values (picklable): a mapping of named fields where ``same``
            compares any; compared fields travel as :func:`plain` values.
        problem: what keeps this rank from taking the call (a sentence), or ``None``.
        error: the error ``problem`` raises on every rank (picklable).
        same: the fields of ``values`` the ranks must agree on, and how.
        device: where the call works; ``None``: no capture check.
        failed: words between the call and the ranks in a problem's message
            (``"could not map on "``).
        tail: words after the problem in its message (``"; nothing stays mapped"``).
        received: called with every rank's values (``None`` for a rank with a problem):
            what a rank must undo even when the call is refused.

    Returns:
        Every rank's ``values``, in the group's rank order.

    Raises:
        CaptureError, the class a problem carries, or a ``same`` rule's error: on every rank.
        BackendError: a rank died or left before the exchange.
    """
    capturing = _capture_flag(group, device, call=call)
    if problem:
        values = None  # a refused call's values may be anything (junk, unpicklable): none travel
    else:
        problem = error = None
        if same:
            values = {k: plain(v) if k in same else v for k, v in values.items()}
    everyone = gather(group, (values, problem, error, capturing))
    captured = [r for r, (*_, c) in enumerate(everyone) if c]
    if captured:
        raise _capture_error(f"{call}: {ranks_text(captured)}")
    agreed = [v for v, *_ in everyone]
    if received is not None:
        received(agreed)
    bad = [r for r, (_, p, *_) in enumerate(everyone) if p]
    if bad:
        _, first, make, _ = everyone[bad[0]]
        others = f" (and {ranks_text(bad[1:])})" if len(bad) > 1 else ""
        raise make(f"{call}: {failed}rank {bad[0]}{others}: {first}{tail}")
    for field, rule in (same or {}).items():
        ranks = list(range(len(agreed))) if rule.among is None else list(rule.among)
        if len({repr(agreed[r][field]) for r in ranks}) > 1:
            per = ", ".join(f"rank {r}: {agreed[r][field]!r}" for r in ranks)
            raise rule.error(f"{call}: {field} differs across ranks ({per}); {rule.hint}")
    return agreed


def _capture_error(where: str) -> CaptureError:
    return backends.capture_error(
        where,
        "creating a buffer, view, fence or Signals (or growing a buffer) allocates, maps or copies memory, which a "
        "capture cannot record",
        "Create them before capture: the launches through them (fences, your kernels) can be captured",
    )


def _exchange_on_device(group: Any) -> bool:
    """Whether the group's object exchange runs on a CUDA device (an NCCL group), where a
    capture on the current stream would record it, or break."""
    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device

        return _get_object_coll_device(group) != "cpu"
    except Exception:  # noqa: BLE001 - a private helper of torch: fall back to the backend's name
        return "nccl" in str(dist.get_backend(group)) and "cpu" not in str(dist.get_backend(group))


def _capture_flag(group: Any, device: torch.device | None, *, call: str) -> bool:
    """This rank's part of :func:`agree`'s capture check (its step 1), taken before any
    device work: True when ``device``'s current stream is capturing
    (:func:`symmsync.backends.capturing`); raises here, alone, where the exchange would
    run on the device."""
    if not backends.capturing(device):
        return False
    if _exchange_on_device(group):
        raise _capture_error(f"rank {dist.get_rank(group)}: {call}")
    return True


log = logging.getLogger("symmsync")


class Transaction:
    """One all-or-nothing collective: every rank takes the same steps, and either every
    step succeeds on every rank, or every rank undoes what it did and raises the same
    :class:`~symmsync.BackendError`.

    Each :meth:`step` runs a local action on this rank and exchanges its outcome with
    every rank; when any rank failed, every rank runs the undo actions registered so far
    (:meth:`on_failure`, the latest first) and raises an error naming the call, the
    failing ranks and the first problem. :meth:`commit` is the final barrier: once it
    returns, every rank finished every step. Used as a context manager, any other error
    (a peer that died in an exchange, or in the barrier, is a ``BackendError`` too)
    also runs the undo actions, so nothing stays mapped; leaving the block without
    :meth:`commit` commits.

    Args:
        group: the process group.
        call: the public call it serves, first in every message (``"SymmetricBuffer.grow"``).
        kept: what a failure leaves, last in the message (``"the buffer keeps its 4096 bytes"``).

    Example::

        with Transaction(group, "SymmetricBuffer", kept="nothing stays mapped") as tx:
            handles = tx.step("allocate on", lambda: export(allocate()))
            tx.on_failure(release)
            tx.step("map on", lambda: map_peers(handles))
    """

    def __init__(self, group: Any, call: str, *, kept: str):
        self.group = group
        self.call = call
        self.kept = kept
        self._undo: list[Callable[[], None]] = []
        self._committed = False

    def on_failure(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if this transaction fails (after the undo actions registered later)."""
        self._undo.append(undo)

    def step(self, what: str, local: Callable[[], Any], undo: Callable[[list[Any]], None] | None = None) -> list[Any]:
        """Run ``local()`` here, exchange its outcome, raise on every rank if any rank failed.

        Args:
            what: the step, as the message says it before the ranks (``"map on"``,
                ``"map the registered memory of"``).
            local: this rank's action; what it returns must be picklable.
            undo: called with every rank's result (``None`` for a rank that failed) if
                the transaction fails from this step on: drop what the others sent.

        Returns:
            Every rank's ``local()`` result, in the group's rank order.

        Raises:
            BackendError: on every rank, naming the ranks whose action raised.
        """
        value = problem = None
        try:
            value = local()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            problem = f"{type(e).__name__}: {e}"
        keep = None if undo is None else lambda everyone: self.on_failure(functools.partial(undo, everyone))
        return agree(
            self.group,
            self.call,
            value,
            problem=problem,
            error=BackendError,
            failed=f"could not {what} ",
            tail=f"; {self.kept}",
            received=keep,
        )

    def commit(self) -> None:
        """The final barrier: every rank finished every step; nothing is undone after it."""
        try:
            barrier(self.group)
        except BackendError:
            self.rollback()
            raise
        self._committed = True
        self._undo.clear()

    def rollback(self) -> None:
        """Run the undo actions, the latest first, each once; one that fails is logged and
        skipped (the error being raised says more)."""
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001
                log.warning("%s: undoing a step of a failed collective failed: %s", self.call, e)

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            if not self._committed:
                self.commit()
            return
        self.rollback()
