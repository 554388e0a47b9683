"""How ``algorithm="auto"`` picks an all-reduce algorithm: the one place of its thresholds.

PROVISIONAL. These numbers are estimates, not measurements: they have not yet been
measured on GPUs. ``benchmarks/collectives.py`` prints the crossover it finds on a
machine (the size from which two-shot is faster than one-shot); replace them with
that run's numbers, and say so in docs/collectives.md.

The reasoning behind the estimates: a one-shot call reads ``(size - 1) * nbytes``
from the other members and does the whole sum on every member, in one round trip;
a two-shot call reads ``2 * (size - 1) / size * nbytes`` and sums ``1 / size`` of the
elements per member, in two round trips. With 2 members both read ``nbytes``, so
one-shot should win up to large messages; with more members two-shot's smaller
reads win from a few hundred kilobytes.
"""

from __future__ import annotations

ONE_SHOT_MAX_BYTES: dict[int, int] = {1: 1 << 62, 2: 4 << 20, 4: 512 << 10, 8: 256 << 10}
"""Largest message (bytes) that ``"auto"`` sends one-shot, per view size. PROVISIONAL."""
DEFAULT_ONE_SHOT_MAX_BYTES = 256 << 10
"""The same for view sizes not listed. PROVISIONAL."""


def one_shot_max_bytes(size: int) -> int:
    """The largest message ``"auto"`` sends one-shot over ``size`` members."""
    return ONE_SHOT_MAX_BYTES.get(size, DEFAULT_ONE_SHOT_MAX_BYTES)


def choose(nbytes: int, size: int) -> str:
    """The algorithm ``"auto"`` runs for a message of ``nbytes`` over ``size`` members."""
    return "one_shot" if nbytes <= one_shot_max_bytes(size) else "two_shot"
