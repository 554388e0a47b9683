"""How a consumer is made: this rank's checks, the bytes it claims, and the one agreement.

:class:`Making` is one consumer's construction on this rank, collective over the buffer's group::

    make = Making("AllToAll", view)                   # refused under compile; a PeerView; buffer open
    make.ints(max_numel=(max_numel, 1, None))         # this rank's problems: the first one counts
    make.offset(offset)                               # a multiple of 128 (BoundsError otherwise)
    make.fits(offset, nbytes, "allocate more")        # the bytes lie in the buffer
    fence = make.fence(channel, timeout_s)            # a nested refusal is agreed like the rest
    make.claim("AllToAll (channel 0)", offset, offset + nbytes)   # its bytes: no other owner's
    make.agree({"max_numel": max_numel, ...})         # one exchange: every rank raises, or none
    self.made(make, memory="...", no_grad="...")      # symmsync.core.consumer.Consumer.made

:meth:`Making.agree` is the construction's one exchange (:func:`.agreement.agree`): every rank
raises the first problem any rank found (with its error class), or a difference among the
view's members in the agreed arguments, or none does. It also exchanges which GPU each rank
runs on, so that a consumer knows the members that share its GPU (:attr:`Making.shares_gpu`).
"""

from __future__ import annotations

import socket
from typing import Any

import torch

from .. import backends
from ..checks import int_problem
from ..errors import BoundsError, ClosedError, ConfigError
from ..language.cells import LINE
from . import agreement
from .fence import Fence
from .regions import Region
from .views import PeerView


def gpu_identity(device: torch.device) -> str:
    """A name of ``device`` that is the same in every process using it: its UUID (where torch
    gives none, the host and the device index)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}:{device.index}"


class Making:
    """One consumer's construction on this rank (the module's docstring shows the steps).

    Args:
        call: the consumer, as its messages name it (``"AllReduce"``, ``"moe.Dispatcher"``).
        view: its view.

    Raises at once (no exchange can be made): :class:`~symmsync.CaptureError` under compile
    (``backends.refuse_compiling``), :class:`~symmsync.ConfigError` for a ``view`` that is no
    :class:`~symmsync.PeerView`, :class:`~symmsync.ClosedError` for a closed buffer.

    Attributes:
        call: the consumer's name.
        view: its view; ``buffer``: the view's buffer.
        problem: the first problem this rank found (a sentence without the rank), or ``None``.
        error: the class it raises (:class:`~symmsync.ConfigError` or a subclass).
        regions: the byte ranges the object will claim (:meth:`claim`).
        waits: the fences made with :meth:`fence` (the consumer's ``settle()`` reads their records).
        shares_gpu: after :meth:`agree`, the other members of the view that run on this rank's
            GPU (several processes on one device), in view order.
    """

    def __init__(self, call: str, view: Any):
        backends.refuse_compiling(call)
        if not isinstance(view, PeerView):
            raise ConfigError(f"{call}: view must be a symmsync.PeerView, got {type(view).__name__}")
        buf = view.buffer
        if buf.closed:
            raise ClosedError(f"rank {buf.rank}: {call}: the view's buffer is closed")
        self.call, self.view, self.buffer = call, view, buf
        self.problem: str | None = None
        self.error: type = ConfigError
        self.regions: list[Region] = []
        self.waits: list[Any] = []
        self.shares_gpu: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        """True while this rank found no problem: the next check is worth making."""
        return self.problem is None

    def check(self, problem: str | None, error: type = ConfigError) -> bool:
        """Keep ``problem`` (raising ``error`` on every rank) unless one was found before; return :attr:`ok`."""
        if self.problem is None and problem is not None:
            self.problem, self.error = problem, error
        return self.problem is None

    def ints(self, **specs: tuple[Any, int | None, int | None]) -> bool:
        """Check int arguments, ``name=(value, minimum, maximum)`` (``None``: no bound), in order."""
        for name, (value, lo, hi) in specs.items():
            if self.ok:
                self.check(int_problem(name, value, minimum=lo, maximum=hi))
        return self.ok

    def offset(self, offset: Any) -> bool:
        """Check a workspace's ``offset``: an int of at least 0, a multiple of 128 (BoundsError)."""
        if self.ints(offset=(offset, 0, None)) and offset % LINE:
            self.check(f"offset must be a multiple of {LINE} bytes, got {offset}", BoundsError)
        return self.ok

    def fits(self, start: int, nbytes: int, grow: str) -> bool:
        """Check that bytes ``[start, start + nbytes)`` lie in the buffer (:class:`~symmsync.BoundsError`);
        ``grow`` says what to do (``"allocate symmsync.moe.buffer_bytes(...) more"``)."""
        total = self.buffer.nbytes
        if self.ok and start + nbytes > total:
            self.check(
                f"the workspace needs bytes [{start}, {start + nbytes}) of the buffer, which holds {total}: {grow}",
                BoundsError,
            )
        return self.ok

    def fence(self, channel: Any, timeout_s: Any, view: PeerView | None = None) -> Fence | None:
        """The object's :class:`~symmsync.Fence` on ``channel`` of ``view`` (default: its view), or
        ``None`` where this rank has a problem (the fence's own refusal, a bad channel or timeout,
        is kept as one: agreed like the rest, so that every rank raises). The consumer's
        ``settle()`` reads the fence's record (:attr:`waits`)."""
        if not self.ok:
            return None
        fence, problem, error = agreement.attempt(
            lambda: Fence(view or self.view, channel, timeout_s=timeout_s), self.buffer.rank
        )
        if self.check(problem, error):
            self.waits.append(fence)
        return fence

    def claim(self, owner: str, start: int, stop: int, share: Any = None) -> Region | None:
        """The bytes ``[start, stop)`` the object will own (:class:`.regions.Region`; ``share``: the key of
        owners that may share them), checked against the buffer's owners now and claimed by
        :meth:`~symmsync.core.consumer.Consumer.made`; ``None`` where this rank has a problem."""
        if not self.ok:
            return None
        region = Region(owner, start, stop, share=share)
        if self.check(self.buffer.regions.problem(region)):
            self.regions.append(region)
        return region

    def agree(
        self,
        arguments: dict[str, Any],
        *,
        hint: str | None = None,
        group_wide: dict[str, tuple[Any, agreement.Same | None]] | None = None,
    ) -> list[Any]:
        """The construction's one exchange (collective over the buffer's group).

        Every rank raises the first rank's problem (with its class), or a difference among the
        view's members in ``arguments``, or one of ``group_wide`` that differs, or none does.

        Args:
            arguments: the values the view's members must pass alike, by the names the messages
                give them (``"the dtype"``).
            hint: what to do when they differ (default: every member of the view must pass the same).
            group_wide: more fields, ``name: (value, rule)``: compared by their
                :class:`.agreement.Same` rule (``None``: exchanged only, not compared).

        Returns:
            Every rank's values, in the group's rank order (:func:`.agreement.agree`).
        """
        members = tuple(self.view.ranks)
        alike = agreement.Same(
            among=members, hint=hint or f"every member of the view {list(members)} must pass the same"
        )
        mine, same = dict(arguments), dict.fromkeys(arguments, alike)
        for name, (value, rule) in (group_wide or {}).items():
            mine[name] = value
            if rule is not None:
                same[name] = rule
        buf = self.buffer
        gpu = gpu_identity(buf.device) if buf.capabilities.streams else None
        mine[" the GPU"] = gpu  # exchanged, not compared
        every = agreement.agree(
            buf.group, self.call, mine, problem=self.problem, error=self.error, same=same, device=buf.device
        )
        self.shares_gpu = tuple(r for r in members if r != buf.rank and gpu and every[r][" the GPU"] == gpu)
        return every
