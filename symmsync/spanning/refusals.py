"""Refused calls told through torch.distributed's store, where no kernel carries the news.

A consumer whose members exchange through torch.distributed (the PCP writer's gathered routes)
or across nodes (the collectives' forms over nodes) cannot mark a refusal in a fence cell that
every member reads. There the refusing member still takes its part of the call, marked
refused where the call's own data can say so, and before its first step it posts a record
here: ``(its rank, the call's number, its problem, a note)``. A member reads the records once
its own call of that number is over (the refusing member's part of it was needed, and so was
posted before), and raises :class:`~symmsync.PeerRefused` for them.

The keys are the consumer's: ``symmsync/refused/<view name>/<kind><n>/...``, the ``n``-th
consumer of that kind on the view made in this process (consumers are made collectively:
the same ``n`` on every member).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .exchange import default_store

if TYPE_CHECKING:
    from ..core.views import PeerView

_SERIALS: dict[tuple[str, str], int] = {}


class Refusals:
    """One consumer's refused calls (see the module's docstring).

    Args:
        view: the consumer's view (its name keys the records).
        rank: this rank (the buffer group's), the origin its records name.
        kind: the consumer's kind, in the key (``"writer"``, ``"AllReduce"``).
    """

    def __init__(self, view: PeerView, rank: int, kind: str):
        n = _SERIALS[(view.name, kind)] = _SERIALS.get((view.name, kind), 0) + 1
        self.key, self.rank = f"symmsync/refused/{view.name}/{kind}{n}", rank
        self._read = 0  # records read from the store
        self._own: set[int] = set()  # the calls this rank refused (its own error said enough)
        self._later: list[tuple[int, int, str, str]] = []  # records of calls this rank has not made yet

    def post(self, number: int, problem: str, note: str = "") -> None:
        """Post this rank's refusal of its call ``number``, before the call's first step."""
        store = default_store()
        self._own.add(number)
        i = store.add(f"{self.key}/count", 1)
        store.set(f"{self.key}/{i}", f"{self.rank}\n{number}\n{note}\n{problem}")

    def read(self, done: int) -> list[tuple[int, int, str, str]]:
        """The members' refusals of this rank's calls up to ``done`` (whose calls are over), not
        read before, in call order, as ``(rank, number, problem, note)``; this rank's own refused
        calls left out. Records of later calls are kept for a later read."""
        store = default_store()
        count = store.add(f"{self.key}/count", 0)
        for i in range(self._read + 1, count + 1):
            origin, number, note, problem = store.get(f"{self.key}/{i}").decode(errors="replace").split("\n", 3)
            self._later.append((int(origin), int(number), problem, note))
        self._read = count
        due = sorted((r for r in self._later if r[1] <= done), key=lambda r: r[1])
        self._later = [r for r in self._later if r[1] > done]
        return [r for r in due if r[1] not in self._own]
