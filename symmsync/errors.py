"""The exceptions symmsync raises.

Every error the library raises on purpose is a :class:`SymmSyncError`. Collective
entry points (buffer allocation, peer views, the PCP writer) check their arguments on
every rank after one exchange (:mod:`symmsync.core.agreement`), so a bad argument on one
rank raises the same error on all of them instead of leaving the others waiting in a
collective. Messages name the rank and the call.

One class per kind of mistake (:mod:`symmsync.checks` words them):

* a value of the wrong type, or outside what the argument allows: :class:`ConfigError`;
* an index or byte range outside what exists (a rank, a view member, a channel, a
  layer, bytes past a region, a misaligned offset): :class:`BoundsError`;
* ranks that disagree: :class:`SizeMismatchError` (sizes), :class:`ViewError` (views),
  else :class:`ConfigError` naming what differs;
* a creation during CUDA graph capture: :class:`CaptureError`;
* a consumer kernel's tensor inputs: :class:`InputError`.
"""

from __future__ import annotations

from typing import Any


class SymmSyncError(RuntimeError):
    """Base class of every error symmsync raises on purpose."""


class ConfigError(SymmSyncError, ValueError):
    """An argument is invalid: a size, rank list, channel or layout.

    The message names the rank that passed it, the value, and what to do.
    """


class SizeMismatchError(ConfigError):
    """A collective allocation was asked for different sizes on different ranks."""


class BoundsError(ConfigError):
    """An index or byte range outside what exists: a rank, a view member, a channel, a
    layer, a tensor view past the buffer's user region or off its 16-byte alignment."""


class ViewError(ConfigError):
    """A peer view's rank list is invalid or inconsistent across its members."""


class CaptureError(ConfigError):
    """A buffer, view or fence was created (or a buffer grown) while a CUDA graph was being
    captured on the current stream. Creating one allocates, maps or copies memory, which
    a capture cannot record: create them before capture; launches through them (fences,
    your kernels) can be captured. Raised before any device work, so the capture goes on
    unharmed; collective calls raise it on every rank."""


class ClosedError(SymmSyncError):
    """The buffer (or a view or fence over it) was used after ``close()``."""


class BackendError(SymmSyncError):
    """A memory backend is unavailable here, or allocating or mapping failed.

    Allocation is all or nothing: when this is raised by a collective, every rank
    raises it and none keeps a partly mapped buffer.
    """


class FenceTimeout(SymmSyncError, TimeoutError):
    """A fence's wait failed: its time budget ran out, or a member gave up (see
    :class:`PeerAborted`). A wait that times out or sees an abort fails closed: nothing
    after it may read peer data.

    Attributes:
        rank: global rank whose wait failed.
        epoch: the epoch it was waiting for.
        late: ``{peer global rank: epoch that peer's slot held}`` for every peer that
            had not published the epoch and had not aborted: it did not reach the fence
            (crashed, hung, or took another path), or its launch reached the wait without
            publishing (the message says so when this rank's own launch did).
        channel: the fence channel.
        aborted: ``{peer global rank: reason}`` for every peer that had not arrived and
            had aborted instead (empty for a plain timeout). The reason ``"closed"``
            means the peer closed its buffer.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        epoch: int,
        late: dict[int, int],
        channel: int,
        aborted: dict[int, str] | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.epoch = epoch
        self.late = dict(late)
        self.channel = channel
        self.aborted = dict(aborted or {})

    @property
    def closed(self) -> list[int]:
        """The peers among :attr:`aborted` that closed their buffer, in rank order."""
        return sorted(r for r, why in self.aborted.items() if why == CLOSED_REASON)

    def __reduce__(self):
        return (
            _rebuild_fence_timeout,
            (type(self), str(self), self.rank, self.epoch, self.late, self.channel, self.aborted),
        )


class PeerAborted(FenceTimeout):
    """A member of the view gave up before publishing the epoch this rank waited for.

    Raised at once (within a poll of the wait, not after the time budget) when a peer
    called :meth:`~symmsync.Fence.abort` or :meth:`~symmsync.PeerView.abort`, failed in a
    symmsync operation, or closed its buffer. A subclass of :class:`FenceTimeout`, so
    ``except FenceTimeout`` catches it too. :attr:`aborted` maps each such peer's global
    rank to its reason (``"closed"`` for a peer that closed its buffer); a rank that
    aborted a view itself raises it naming its own rank (with ``epoch`` -1) when it
    fences on that view again.
    """


#: The reason a peer's abort carries when it came from ``SymmetricBuffer.close()``.
CLOSED_REASON = "closed"


def _rebuild_fence_timeout(cls, message, rank, epoch, late, channel, aborted=None):
    return cls(message, rank=rank, epoch=epoch, late=late, channel=channel, aborted=aborted)


class InputError(ConfigError):
    """A consumer kernel's input is wrong (shape, dtype, layout, slot mapping).

    Raised before any byte is written.
    """


class CallMismatch(InputError):
    """The members of a consumer's view made different calls (another kind of call, other size
    words, or a different count of calls): found in the call's kernel on every member from the
    members' call headers, before anything of the call was read; its outputs hold the consumer's
    poison. The consumer fails: every later call raises this again (make a new one).

    Attributes:
        rank: this member's global rank.
        number: the call's number on this member (the calls it made before it).
        calls: ``{global rank: {field: value}}``: what each member called with.
        differs: the fields that differ.
        other: the global rank of the first member whose call differed from this member's.
    """

    def __init__(
        self, message: str, *, rank: int, number: int, calls: dict[int, dict[str, Any]], differs: list[str], other: int
    ):
        super().__init__(message)
        self.rank = rank
        self.number = number
        self.calls = calls
        self.differs = differs
        self.other = other

    def __reduce__(self):
        return (
            _rebuild_mismatch,
            (type(self), str(self), self.rank, self.number, self.calls, self.differs, self.other),
        )


def _rebuild_mismatch(cls, message, rank, number, calls, differs, other):
    return cls(message, rank=rank, number=number, calls=calls, differs=differs, other=other)


class PeerRefused(SymmSyncError):
    """Another member of the view refused its part of this call: its input failed its checks
    (it raised :class:`InputError`). The object stays usable: the members' next call goes on.
    A collective's or a dispatcher's refused call wrote no member's output; a refused write of
    the direct-KV writer wrote the other members' rows of the layer, and none of the refusing
    member's. Every refusal is worded by :func:`peer_refused`.

    Attributes:
        rank: this member's global rank.
        origin: the global rank of the member that refused.
        reason: why it refused, as far as this member knows.
    """

    def __init__(self, message: str, *, rank: int, origin: int, reason: str):
        super().__init__(message)
        self.rank = rank
        self.origin = origin
        self.reason = reason

    def __reduce__(self):
        return (_rebuild_peer_refused, (str(self), self.rank, self.origin, self.reason))


def _rebuild_peer_refused(message, rank, origin, reason):
    return PeerRefused(message, rank=rank, origin=origin, reason=reason)


def peer_refused(
    rank: int, what: str, ranks: Any, when: str, origin: int, part: str, reason: str, outcome: str
) -> PeerRefused:
    """The one wording of a :class:`PeerRefused`: ``rank <rank>: <what> on view <ranks> (<when>): rank
    <origin> refused its <part>: <reason>; <outcome>`` (``what`` the call, ``part`` what the origin
    refused: ``call``, ``write``, ``dispatch``; ``outcome`` what the members' calls did and what to do)."""
    return PeerRefused(
        f"rank {rank}: {what} on view {list(ranks)} ({when}): rank {origin} refused its {part}: {reason}; {outcome}",
        rank=rank,
        origin=origin,
        reason=reason,
    )


class RankFailure(SymmSyncError):
    """Raised by :func:`symmsync.testing.run` when a rank failed or hung.

    Attributes:
        rank: the first rank that failed (or ``None`` for a hang of several).
        remote_traceback: that rank's formatted traceback, when it raised.
    """

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (_rebuild_rank_failure, (str(self), self.rank, self.remote_traceback))


def _rebuild_rank_failure(message, rank, remote_traceback):
    return RankFailure(message, rank=rank, remote_traceback=remote_traceback)


class SignalTimeout(FenceTimeout):
    """A signal wait (:func:`symmsync.language.wait_signal` or
    :func:`~symmsync.language.wait_count`) gave up: its budget ran out before the slot met
    the comparison. A wait that times out or sees an abort fails closed: nothing after it
    may read peer data.

    The :class:`FenceTimeout` fields hold: ``rank`` (the waiting rank), ``epoch`` (the value
    the slot had to reach: ``base + count`` for a counted wait), ``late`` (``{peer rank:
    observed value}``), ``channel`` (-1: signals have no channel).

    Attributes:
        peer: global rank of the member whose slot was awaited.
        slot: the slot.
        cmp: the comparison, ``"EQ"`` ... ``"LT"`` (``"GE"`` for a counted wait).
        expected: the value awaited (for a counted wait: the count beyond ``base``).
        observed: the slot's value when the wait gave up.
        base: what earlier counted waits had consumed (0 for an absolute wait).
        counted: True for :func:`~symmsync.language.wait_count`.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        peer: int,
        slot: int,
        cmp: str,
        expected: int,
        observed: int,
        base: int = 0,
        counted: bool = False,
        aborted: dict[int, str] | None = None,
    ):
        target = base + expected if counted else expected
        super().__init__(
            message, rank=rank, epoch=target, late={} if aborted else {peer: observed}, channel=-1, aborted=aborted
        )
        self.peer = peer
        self.slot = slot
        self.cmp = cmp
        self.expected = expected
        self.observed = observed
        self.base = base
        self.counted = counted

    def __reduce__(self):
        fields = (self.rank, self.peer, self.slot, self.cmp, self.expected, self.observed, self.base, self.counted)
        return (_rebuild_signal_timeout, (type(self), str(self), *fields, self.aborted))


class SignalAborted(SignalTimeout, PeerAborted):
    """A member of the view gave up while this rank waited for a signal: the wait ended at
    once (within a poll). Both a :class:`SignalTimeout` (the slot, the value awaited and
    observed) and a :class:`PeerAborted` (:attr:`aborted` names the member and its reason)."""


def _rebuild_signal_timeout(cls, message, rank, peer, slot, cmp, expected, observed, base, counted, aborted):
    return cls(
        message,
        rank=rank,
        peer=peer,
        slot=slot,
        cmp=cmp,
        expected=expected,
        observed=observed,
        base=base,
        counted=counted,
        aborted=aborted,
    )


class DebugCheckError(SymmSyncError):
    """A check of debug mode (``SYMMSYNC_DEBUG=1``) caught a misuse inside a kernel: a
    second program publishing on one channel in one launch, a peer offset outside the
    user region, or a counted wait (``wait_count``) on a slot a peer SET. The message names
    the rank, the program and the offset (or slot). On GPUs the kernel prints the same and
    traps. (Indices out of range are checked always: :class:`IndexCheckError`.)"""


class IndexCheckError(SymmSyncError, IndexError):
    """A kernel passed a signal or fence primitive an index out of range: a peer or a member
    index outside ``[0, SIZE)``, or a slot outside ``[0, NSLOTS)``.

    Checked on every call, debug mode or not. The access is not made (no member's word is
    read or written through the bad index); the kernel records the rank, the program, the
    primitive, which index, its value and the bound. Under the interpreter the launch raises
    this error; on GPUs the kernel prints the same, writes the record and traps, and
    :meth:`Signals.check() <symmsync.Signals.check>` / :meth:`~symmsync.Signals.synchronize`
    (or the fence's :meth:`~symmsync.Fence.synchronize`) raise it from the record.

    Attributes:
        rank: the rank whose kernel made the call (-1 when the kernel did not know it).
        primitive: the primitive's name (``"signal"``, ``"wait"``, ...).
        which: ``"peer"``, ``"slot"`` or ``"member"``.
        value: the index passed.
        bound: the exclusive upper bound it had to stay below (and >= 0).
    """

    def __init__(self, message: str, *, rank: int, primitive: str, which: str, value: int, bound: int):
        super().__init__(message)
        self.rank, self.primitive, self.which, self.value, self.bound = rank, primitive, which, value, bound

    @classmethod
    def describe(
        cls, rank: int, primitive: str, program: object, which: str, value: int, bound: int
    ) -> IndexCheckError:
        """The error, with its message, for what a kernel's check found (its report or its record)."""
        fix = {
            "peer": "pass a view index in [0, SIZE) (Signals.size, view.size)",
            "slot": "pass a slot in [0, NSLOTS) (Signals.slots)",
            "member": "pass this rank's view.local_index (the me of kernel_args)",
        }
        message = (
            f"rank {rank}, program {program}: {primitive}: {which} index {value} is out of range [0, {bound}); "
            f"nothing was read or written through it. Fix the kernel: {fix.get(which, 'keep the index in range')}"
        )
        return cls(message, rank=rank, primitive=primitive, which=which, value=value, bound=bound)

    def __reduce__(self):
        return _rebuild_index_check, (str(self), self.rank, self.primitive, self.which, self.value, self.bound)


def _rebuild_index_check(message, rank, primitive, which, value, bound):
    return IndexCheckError(message, rank=rank, primitive=primitive, which=which, value=value, bound=bound)
