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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .errors import BackendError, ConfigError, SymmSyncError


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
