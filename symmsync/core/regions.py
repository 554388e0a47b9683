"""Who owns which bytes of a buffer's user region: claims, and the offsets to claim.

Every consumer that takes bytes of a :class:`~symmsync.SymmetricBuffer`'s user region
claims them when it is made (a collective's workspace, the writer's caches, a user's
named region: :meth:`~symmsync.SymmetricBuffer.claim`), and a claim that overlaps one
already held is refused on every rank, naming both owners and their ranges. The rule
that allows two claims to share bytes is one: they are the same range with the same
*share key*, which a consumer gives only where sharing is the same as one object's
calls (collectives of one layout on one view and fence channel; writers of one cache
layout on one view). Signals and fences take none of these bytes: signals have an
allocation of their own, a fence its channel's cell. A consumer's ``close()`` gives its
claims back on every member at once, after every member's calls are over
(:func:`symmsync.core.agreement.release_together`); a consumer dropped without it gives
them back when it is collected.

:func:`carve` gives the offsets to claim, aligned, from the sizing helpers' byte
counts, in place of hand arithmetic::

    plan = ss.carve(all_reduce=collectives.workspace_bytes(n, torch.bfloat16, world),
                    caches=pcp.CacheLayout(num_blocks=b, num_layers=l).nbytes)
    buf = ss.SymmetricBuffer(plan.nbytes)
    ar = collectives.AllReduce(view, n, torch.bfloat16, offset=plan["all_reduce"])
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checks import int_problem
from ..errors import ConfigError
from ..language.cells import LINE  # the alignment carve() gives by default (see carve)

__all__ = ["LINE", "Carving", "Region", "Regions", "carve"]


@dataclass(frozen=True)
class Region:
    """Bytes ``[start, stop)`` of a buffer's user region, claimed by ``owner``.

    ``share``: claims with equal keys (not ``None``) and the same range may be held at
    once; ``None`` shares with nothing.
    """

    owner: str
    start: int
    stop: int
    share: Hashable | None = field(default=None, compare=False)

    def overlaps(self, other: Region) -> bool:
        """Whether the two share a byte (an empty region shares none)."""
        return self.start < other.stop and other.start < self.stop

    def may_share(self, other: Region) -> bool:
        """The one sharing rule: the same range and the same share key."""
        same_range = (self.start, self.stop) == (other.start, other.stop)
        return same_range and self.share is not None and self.share == other.share

    def __str__(self) -> str:
        return f"{self.owner} at bytes [{self.start}, {self.stop})"


class Regions:
    """The claims held on one rank's buffer (this rank's view of them: every rank makes
    the same claims in the same order, as the constructors that make them are collective).

    A claim is held until its holder is closed or collected, or :meth:`release`.
    """

    def __init__(self) -> None:
        self._held: dict[int, Region] = {}
        self._keys = itertools.count()

    def __iter__(self) -> Iterator[Region]:
        return iter(sorted(self._held.values(), key=lambda r: (r.start, r.stop)))

    def __len__(self) -> int:
        return len(self._held)

    def conflict(self, wanted: Region) -> Region | None:
        """The first held claim ``wanted`` overlaps and may not share, or ``None``.

        Claims whose holders are garbage but not yet collected (a reference cycle) are
        collected first where they would refuse: so every rank sees the same claims.
        """
        found = self._first_conflict(wanted)
        if found is not None:
            gc.collect()  # a holder in a cycle releases its claim when collected
            found = self._first_conflict(wanted)
        return found

    def _first_conflict(self, wanted: Region) -> Region | None:
        for held in self:
            if held.overlaps(wanted) and not held.may_share(wanted):
                return held
        return None

    def problem(self, wanted: Region) -> str | None:
        """What is wrong with claiming ``wanted`` (``None``: nothing), for an agreement."""
        held = self.conflict(wanted)
        if held is None:
            return None
        return (
            f"{wanted} overlaps {held}: two owners may share bytes only where docs/concepts.md "
            "('Who owns which bytes') allows it; take each its own bytes, e.g. offsets from symmsync.carve(...)"
        )

    def claim(self, region: Region, holder: Any = None) -> int:
        """Hold ``region`` (checked with :meth:`problem` first) until ``holder`` is collected
        or :meth:`release` is called with the key this returns."""
        key = next(self._keys)
        if region.stop > region.start:
            self._held[key] = region
            if holder is not None:
                weakref.finalize(holder, self._held.pop, key, None).atexit = False
        return key

    def release(self, key: int) -> None:
        """Drop a claim (idempotent)."""
        self._held.pop(key, None)


class Carving(Mapping[str, int]):
    """Offsets of named regions, in the order given, each aligned; :attr:`nbytes` holds them all."""

    def __init__(self, spans: dict[str, tuple[int, int]], nbytes: int):
        self._spans = spans
        self.nbytes = nbytes
        """Bytes a buffer needs for every region (the end of the last one)."""

    def __getitem__(self, name: str) -> int:
        return self._spans[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)

    def span(self, name: str) -> tuple[int, int]:
        """``(start, stop)`` of a region."""
        return self._spans[name]

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}=[{a}, {b})" for k, (a, b) in self._spans.items())
        return f"Carving({parts}, nbytes={self.nbytes})"


def carve(*, start: int = 0, align: int = LINE, **sizes: int) -> Carving:
    """Place regions of the given byte counts one after another, each at a multiple of ``align``.

    Args:
        start: where the first region may start.
        align: every region's start is a multiple of it (default :data:`LINE`, 128: what
            every symmsync consumer takes).
        sizes: region name = its bytes (from the sizing helpers:
            ``collectives.workspace_bytes``, ``pcp.CacheLayout(...).nbytes``, your own).

    Returns:
        a :class:`Carving`: ``plan[name]`` is a region's offset, ``plan.nbytes`` the size
        to allocate.

    Raises:
        ConfigError: a size, ``start`` or ``align`` that is not a non-negative int
            (``align`` positive).
    """
    problem = int_problem("align", align, minimum=1) or int_problem("start", start, minimum=0)
    for name, n in sizes.items():
        problem = problem or int_problem(f"the size of {name!r}", n, minimum=0)
    if problem:
        raise ConfigError(f"symmsync.carve: {problem}")
    spans, at = {}, start
    for name, n in sizes.items():
        at = -(-at // align) * align
        spans[name] = (at, at + n)
        at += n
    return Carving(spans, at)
