"""Agreement among the ranks of a group: the one place symmsync talks to torch.distributed.

Every collective entry point of symmsync (a buffer, a view, a consumer such as the
PCP writer) follows one pattern: each rank checks its own arguments into a problem
(a sentence, or ``None``), one exchange carries every rank's problem and the values
the ranks must agree on, and then every rank raises the same error, or none does.
No rank is left waiting in a collective that another rank skipped.

    values = agree(group, mine, problem, call="DirectKVWriter")   # raises on every rank
    same(values, "route", call="DirectKVWriter")                 # raises on every rank

A peer that died or left makes the exchange fail on the others: they raise
:class:`~symmsync.BackendError` saying so, never torch.distributed's own error.

What maps memory runs as a :class:`Transaction`: all or nothing on every rank.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from . import backends
from .errors import BackendError, CaptureError, ConfigError, SymmSyncError


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


def _lost_peer(group: Any, e: Exception) -> BackendError:
    return BackendError(
        f"rank {dist.get_rank(group)}: an exchange with the other ranks of the group failed: a rank "
        f"probably died or left the collective (check the other ranks' logs). torch.distributed: {e}"
    )


def plain(v: Any) -> Any:
    """``v`` if every rank can receive and compare it, else its repr (a junk argument
    must still reach the exchange, so that every rank raises instead of one)."""
    return v if isinstance(v, (int, str, float, bool, type(None))) else repr(v)


def ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 3"`` or ``"ranks 1, 3"``."""
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def raise_first(
    problems: Sequence[str | None],
    *,
    call: str,
    error: Callable[[str], SymmSyncError] = ConfigError,
    ranks: Sequence[int] | None = None,
    tail: str = "",
) -> None:
    """Raise ``error`` naming the first rank with a problem (and the others that had one).

    ``problems[i]`` belongs to ``ranks[i]`` (default: rank ``i``). Every rank that calls it
    with the same list raises the same error.
    """
    ranks = list(range(len(problems))) if ranks is None else list(ranks)
    bad = [r for r, p in zip(ranks, problems) if p]
    if not bad:
        return
    first = problems[ranks.index(bad[0])]
    others = f" (and {ranks_text(bad[1:])})" if len(bad) > 1 else ""
    raise error(f"{call}: rank {bad[0]}{others}: {first}{tail}")


def agree(
    group: Any,
    value: Any,
    problem: str | None,
    *,
    call: str,
    error: Callable[[str], SymmSyncError] = ConfigError,
) -> list[Any]:
    """Exchange ``(value, problem)``; raise on every rank if any rank had a problem.

    Returns every rank's ``value``, in the group's rank order.
    """
    everyone = gather(group, (value, problem))
    raise_first([p for _, p in everyone], call=call, error=error)
    return [v for v, _ in everyone]


def same(
    values: Sequence[Any],
    what: str,
    *,
    call: str,
    error: Callable[[str], SymmSyncError] = ConfigError,
    ranks: Sequence[int] | None = None,
    hint: str = "pass the same on every rank",
) -> None:
    """Raise on every rank unless ``values`` (one per rank of ``ranks``) are all equal."""
    ranks = list(range(len(values))) if ranks is None else list(ranks)
    if len({repr(v) for v in values}) > 1:
        per = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
        raise error(f"{call}: {what} differs across ranks ({per}); {hint}")


def _capture_text() -> str:
    return (
        "called while a CUDA graph was being captured on its current stream; creating a buffer, "
        "view, fence or Signals (or growing a buffer) allocates, maps or copies memory, which a capture cannot record. "
        "Create them before capture: the launches through them (fences, your kernels) can be captured"
    )


def _exchange_on_device(group: Any) -> bool:
    """Whether the group's object exchange runs on a CUDA device (an NCCL group), where a
    capture on the current stream would record it, or break."""
    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device

        return _get_object_coll_device(group) != "cpu"
    except Exception:  # noqa: BLE001 - a private helper of torch: fall back to the backend's name
        return "nccl" in str(dist.get_backend(group)) and "cpu" not in str(dist.get_backend(group))


def capture_flag(group: Any, device: torch.device | None, *, call: str) -> bool:
    """This rank's part of a collective call's check for CUDA graph capture, taken before
    any device work: True when ``device``'s current stream is capturing
    (:func:`symmsync.backends.capturing`). The caller sends it in the call's argument
    exchange and every rank raises with :func:`raise_if_capturing`.

    Where that exchange would itself run on the device (the object collectives of an
    NCCL group), it cannot run during capture: this rank raises
    :class:`~symmsync.errors.CaptureError` here, before the exchange (ranks that capture
    the same code raise the same; one that did not capture waits in the exchange until
    the group's timeout, as for a rank that left).
    """
    if not backends.capturing(device):
        return False
    if _exchange_on_device(group):
        raise CaptureError(f"rank {dist.get_rank(group)}: {call}: {_capture_text()}")
    return True


def raise_if_capturing(flags: Sequence[bool], *, call: str) -> None:
    """Raise :class:`~symmsync.errors.CaptureError` on every rank when any rank's
    :func:`capture_flag` was True (``flags[r]`` is rank ``r``'s), naming those ranks."""
    bad = [r for r, f in enumerate(flags) if f]
    if bad:
        raise CaptureError(f"{call}: {ranks_text(bad)}: {_capture_text()}")


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
        everyone = gather(self.group, (value, problem))
        if undo is not None:
            self.on_failure(functools.partial(undo, [v for v, _ in everyone]))
        bad = [r for r, (_, p) in enumerate(everyone) if p]
        if bad:
            raise BackendError(f"{self.call}: could not {what} {ranks_text(bad)}: {everyone[bad[0]][1]}; {self.kept}")
        return [v for v, _ in everyone]

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
