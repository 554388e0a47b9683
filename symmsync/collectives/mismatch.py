"""What a collective's errors say of its calls: members whose calls differ (their headers, in the
words of the collectives), and a launch whose grid stalled. What makes a call valid on one member
is one function, :func:`.inputs.call_problem`; the call header and the path of a
failure from the device to the raise are the consumer kit's (:mod:`symmsync.core.consumer`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import CallMismatch, FenceTimeout
from ..language import calls as C
from ..language.records import read_collective_record
from . import layout as L


class CollectiveMismatch(CallMismatch):
    """The members of a view made different calls of a collective (size, dtype, algorithm, input
    kind or operation); raised on every member, before anything was summed (the outputs hold
    NaN); the collective fails. A :class:`~symmsync.CallMismatch`: ``rank``, ``number`` (the
    call's), ``calls`` (``{global rank: {field: value}}``), ``differs``, ``other``."""


#: The fields of a call, in a mismatch's words, in this order.
FIELDS = ("operation", "numel", "dtype", "algorithm", "input", "epilogue", "call")


def describe(op: int, numel: int, dtype_code: int, algorithm: int, symmetric: int, epilogue: int, same: bool) -> dict:
    """A member's call in words (what a mismatch shows); ``same``: it is the call compared."""
    if op not in L.OP_NAMES:
        return {"operation": "none (no call of this collective's at this number)", **dict.fromkeys(FIELDS[1:], "-")}
    return {
        "operation": L.OP_NAMES[op],
        "numel": numel,
        "dtype": L.DTYPE_NAMES.get(dtype_code, f"code {dtype_code}"),
        "algorithm": L.ALGORITHM_NAMES.get(algorithm, "-"),
        "input": "symmetric" if symmetric else "copied in",
        "epilogue": f"residual + RMS norm over rows of {epilogue}" if epilogue else "none",
        "call": "this one" if same else "another",
    }


def describe_kit(header: list[int], number: int) -> dict:
    """A member's call header of one node's kernel (:mod:`symmsync.language.calls`) in words."""
    dtype_word = header[C.H_B]
    return describe(
        header[C.H_TAG] - C.TAG,
        header[C.H_A],
        dtype_word % 256,
        header[C.H_C],
        dtype_word // 256,
        header[C.H_D],
        header[C.H_NUMBER] == number,
    )


def differing_calls(
    where: str, headers: dict[int, list[int]], rank: int, number: int, among: str = ""
) -> CollectiveMismatch:
    """The :class:`CollectiveMismatch` of members whose headers across nodes (:func:`.layout.header`) differ.

    Args:
        where: the call, first in the message (``"rank 0: AllReduce on view [0, 1, 2, 3] (call 2)"``).
        headers: ``{global rank: header words}`` of the members compared.
        rank: this member's global rank.
        number: the call's number, as the headers hold it.
        among: which members were compared, after "differ" (``" across nodes"``).
    """
    calls = {
        r: describe(
            h[L.H_TAG] - L.TAG, h[L.H_NUMEL], h[L.H_DTYPE], h[L.H_ALGORITHM], h[L.H_SYMMETRIC], h[L.H_EPILOGUE],
            h[L.H_EPOCH] == number,
        )
        for r, h in headers.items()
    }  # fmt: skip
    differs = [f for f in FIELDS if len({repr(c[f]) for c in calls.values()}) > 1]
    parts = [f"{f}: " + ", ".join(f"rank {r}: {c[f]}" for r, c in calls.items()) for f in differs]
    other = next((r for r in calls if r != rank and calls[r] != calls.get(rank)), rank)
    msg = (
        f"{where}: the members' calls differ{among} ({'; '.join(parts)}). Every member must make the same call "
        "(operation, size, dtype, algorithm, input kind) in the same order; nothing was summed, and the "
        "collective fails from now on"
    )
    return CollectiveMismatch(msg, rank=rank, number=number, calls=calls, differs=differs, other=other)


class StallRecord:
    """The collective's own record: a launch whose grid barrier ran out of time (its programs were
    not all resident at once). One of the consumer's waits (``Consumer.waits``): the kit reads it
    as it reads a fence's record."""

    def __init__(self, words: Any, name: str, ranks: Sequence[int], fence: Any):
        self.words, self.name, self.ranks, self.fence = words, name, ranks, fence
        self.timeout_s = fence.timeout_s

    def timeout_error(self) -> FenceTimeout | None:
        rec = read_collective_record(self.words.tolist())
        if rec is None:
            return None
        ranks = self.ranks
        return FenceTimeout(
            f"rank {ranks[rec.index]}: {self.name} on view {list(ranks)} (the call of epoch {rec.epoch}): only "
            f"{rec.arrived} programs of its launch arrived within {self.timeout_s:g} s: the launch's programs "
            "were not resident at once (another kernel held the multiprocessors); nothing after it ran",
            rank=ranks[rec.index],
            epoch=rec.epoch,
            late={},
            channel=self.fence.channel,
        )
