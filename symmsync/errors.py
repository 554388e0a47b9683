"""The exceptions symmsync raises.

Every error the library raises on purpose is a :class:`SymmSyncError`. Collective
entry points (buffer allocation, peer views) check their arguments on every rank
after one exchange, so a bad argument on one rank raises the same error on all of
them instead of leaving the others waiting in a collective.
"""

from __future__ import annotations


class SymmSyncError(RuntimeError):
    """Base class of every error symmsync raises on purpose."""


class ConfigError(SymmSyncError, ValueError):
    """An argument is invalid: a size, rank list, channel or layout.

    The message names the rank that passed it, the value, and what to do.
    """


class SizeMismatchError(ConfigError):
    """A collective allocation was asked for different sizes on different ranks."""


class BoundsError(ConfigError):
    """A view would leave the buffer or break its 16-byte alignment."""


class ViewError(ConfigError):
    """A peer view's rank list is invalid or inconsistent across its members."""


class ClosedError(SymmSyncError):
    """The buffer (or a view or fence over it) was used after ``close()``."""


class BackendError(SymmSyncError):
    """A memory backend is unavailable here, or allocating or mapping failed.

    Allocation is all or nothing: when this is raised by a collective, every rank
    raises it and none keeps a partly mapped buffer.
    """


class FenceTimeout(SymmSyncError, TimeoutError):
    """A fence's wait ran out of its time budget; nothing after it ran on stale data.

    Attributes:
        rank: global rank that timed out.
        epoch: the epoch it was waiting for.
        late: ``{peer global rank: epoch that peer's slot held}`` for every peer that
            had not arrived.
        channel: the fence channel.
    """

    def __init__(self, message: str, *, rank: int, epoch: int, late: dict[int, int], channel: int):
        super().__init__(message)
        self.rank = rank
        self.epoch = epoch
        self.late = dict(late)
        self.channel = channel

    def __reduce__(self):
        return (
            _rebuild_fence_timeout,
            (str(self), self.rank, self.epoch, self.late, self.channel),
        )


def _rebuild_fence_timeout(message, rank, epoch, late, channel):
    return FenceTimeout(message, rank=rank, epoch=epoch, late=late, channel=channel)


class InputError(ConfigError):
    """A consumer kernel's input is wrong (shape, dtype, layout, slot mapping).

    Raised before any byte is written.
    """


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
