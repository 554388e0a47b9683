"""What a collective's record says went wrong in a call: members whose calls differ, a launch
that stalled; and what its errors add where members share one GPU. (What makes a call valid
on one member is one function, ``_Collective._problem`` in :mod:`.ops`; a failure's path,
from the record to the raise, is :meth:`symmsync.core.failure.ViewFailure.settle`.)"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch

from .. import errors
from ..errors import FenceTimeout, InputError, PeerRefused, SymmSyncError
from ..language.records import read_collective_record
from . import layout as L


class CollectiveMismatch(InputError):
    """The members of a view made different calls of a collective (size, dtype,
    algorithm, input kind or operation); raised on every member, before anything was summed.

    Attributes:
        rank: this member's global rank.
        epoch: the fence epoch of the refused call (the same on every member in step).
        calls: ``{global rank: {field: value}}``: what each member called with.
        differs: the fields that differ.
    """

    def __init__(self, message: str, *, rank: int, epoch: int, calls: dict[int, dict[str, Any]], differs: list[str]):
        super().__init__(message)
        self.rank = rank
        self.epoch = epoch
        self.calls = calls
        self.differs = differs

    def __reduce__(self):
        return (_rebuild_mismatch, (str(self), self.rank, self.epoch, self.calls, self.differs))


def _rebuild_mismatch(message, rank, epoch, calls, differs):
    return CollectiveMismatch(message, rank=rank, epoch=epoch, calls=calls, differs=differs)


def refused_by(words: list[int], ranks: Sequence[int]) -> tuple[int, int] | None:
    """``(the refusing member's global rank, the call's epoch)`` when the record ``words`` holds a
    refused call (a member's header with a negative ``numel``: :func:`symmsync.collectives.protocol.refused_seen`),
    else ``None``."""
    rec = read_collective_record(words)
    if rec is None or rec.stalled:
        return None
    who = next((p for p, h in enumerate(rec.headers) if h[L.H_NUMEL] < 0), None)
    return None if who is None else (ranks[who], rec.epoch)


def peer_refused(rank: int, name: str, ranks: Sequence[int], origin: int, epoch: int) -> PeerRefused:
    """The :class:`~symmsync.PeerRefused` of a member whose call ``origin`` refused."""
    why = "its arguments failed its checks (its InputError says which)"
    outcome = "no member's call did anything, and the next call goes on"
    return errors.peer_refused(rank, name, ranks, f"the call of epoch {epoch}", origin, "call", why, outcome)


def mismatch_error(
    words: list[int], name: str, ranks: Sequence[int], timeout_s: float, channel: int
) -> SymmSyncError | None:
    """The error a collective's record ``words`` describes (``None`` when it holds none).

    Args:
        words: the record, as written by the kernel (:mod:`symmsync.language.records`' collective record).
        name: the collective, as its errors name it (``"AllReduce"``).
        ranks: the view's members' global ranks, in view order.
        timeout_s, channel: the fence's budget and channel (named in a stall's error).
    """
    rec = read_collective_record(words)
    if rec is None:
        return None
    epoch, me = rec.epoch, rec.index
    where = f"rank {ranks[me]}: {name} on view {list(ranks)} (the call of epoch {epoch})"
    if rec.stalled:
        return FenceTimeout(
            f"{where}: only {rec.arrived} programs of its launch arrived within "
            f"{timeout_s:g} s: the launch's programs were not resident at once (another kernel held "
            "the multiprocessors); nothing after it ran",
            rank=ranks[me],
            epoch=epoch,
            late={},
            channel=channel,
        )
    return differing_calls(where, dict(zip(ranks, rec.headers)), ranks[me], epoch)


def differing_calls(
    where: str, headers: dict[int, list[int]], rank: int, epoch: int, among: str = ""
) -> CollectiveMismatch:
    """The :class:`CollectiveMismatch` of members whose call headers (:mod:`.layout`) differ.

    Args:
        where: the call, first in the message (``"rank 0: AllReduce on view [0, 1] (the call of epoch 2)"``).
        headers: ``{global rank: header words}`` of the members compared.
        rank: this member's global rank.
        epoch: the call's epoch (or number), as the headers hold it.
        among: which members were compared, after "differ" (``" across nodes"``).
    """
    calls = {r: _describe(h, epoch) for r, h in headers.items()}
    fields = list(_describe([L.TAG + L.ALL_REDUCE] + [0] * (L.HEADER_WORDS - 1), 0))
    differs = [f for f in fields if len({repr(c[f]) for c in calls.values()}) > 1]
    parts = [f"{f}: " + ", ".join(f"rank {r}: {c[f]}" for r, c in calls.items()) for f in differs]
    msg = (
        f"{where}: the members' calls differ{among} ({'; '.join(parts)}). Every member must make the same call "
        "(operation, size, dtype, algorithm, input kind) in the same order; nothing was summed, and the "
        "collective fails from now on"
    )
    return CollectiveMismatch(msg, rank=rank, epoch=epoch, calls=calls, differs=differs)


def _describe(h: list[int], epoch: int) -> dict[str, Any]:
    """A member's header, in words (what the error shows)."""
    op = h[L.H_TAG] - L.TAG
    if op not in L.OP_NAMES:
        fields = ("numel", "dtype", "algorithm", "input", "epilogue", "call")
        return {"operation": "none (no call of this collective's at this epoch)", **dict.fromkeys(fields, "-")}
    return {
        "operation": L.OP_NAMES[op],
        "numel": h[L.H_NUMEL],
        "dtype": L.DTYPE_NAMES.get(h[L.H_DTYPE], f"code {h[L.H_DTYPE]}"),
        "algorithm": L.ALGORITHM_NAMES.get(h[L.H_ALGORITHM], "-"),
        "input": "symmetric" if h[L.H_SYMMETRIC] else "copied in",
        "epilogue": f"residual + RMS norm over rows of {h[L.H_EPILOGUE]}" if h[L.H_EPILOGUE] else "none",
        "call": "this one" if h[L.H_EPOCH] == epoch else f"another (epoch {h[L.H_EPOCH]})",
    }


# ---------------------------------------------------------------------- members sharing one GPU
def gpu_identity(device: torch.device) -> str:
    """A name of ``device`` that is the same in every process using it: its UUID (where torch
    gives none, the host and the device index)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}:{device.index}"


def shared_gpu_note(rank: int, others: Sequence[int]) -> str:
    """What every error of a member that shares its GPU with ``others`` adds (docs/gpu.md)."""
    return (
        f"rank {rank} shares its GPU with rank(s) {', '.join(map(str, others))}: a trap in one of their CUDA "
        "contexts can leave another's torch.cuda.synchronize() blocked for good, and this CUDA context may be "
        "unusable; run one rank per GPU"
    )


def stalled_error(
    rank: int, name: str, ranks: Sequence[int], others: Sequence[int], waited_s: float, channel: int
) -> FenceTimeout:
    """The error of ``rank``'s ``synchronize()`` on a shared GPU that saw neither the device finish
    nor a failure recorded within ``waited_s`` (``others``: the members sharing its GPU)."""
    return FenceTimeout(
        f"rank {rank}: {name} on view {list(ranks)}: synchronize() waited {waited_s:g} s, and neither did the "
        f"device finish nor did a call record a failure ({shared_gpu_note(rank, others)})",
        rank=rank,
        epoch=-1,
        late={},
        channel=channel,
    )
