"""The consumer kit: how a consumer of a view (a collective, the direct-KV writer, the MoE
dispatcher, yours) is made, runs its calls' checks and failures, and is closed.

Made: :class:`Making`, one construction on this rank, collective over the buffer's group::

    make = Making("Broadcast", view)                 # refused under compile; a PeerView; buffer open
    make.ints(max_numel=(max_numel, 1, None))         # this rank's problems: the first one counts
    make.offset(offset)                               # a multiple of 128 (BoundsError otherwise)
    make.fits(offset, nbytes, "symmsync.mine.bytes(...)")
    fence = make.fence(channel, timeout_s)            # a nested refusal is agreed like the rest
    make.claim("Broadcast (channel 0)", offset, offset + nbytes)   # its bytes: no other owner's
    make.agree({"max_numel": max_numel, ...})         # one exchange: every rank raises, or none
    self._made(make, "Broadcast (channel 0)", memory=..., no_grad="the broadcast has")

:meth:`Making.agree` is the construction's one exchange (:func:`.agreement.agree`): every rank
raises the first problem any rank found (with its error class), or a difference among the
view's members in the agreed arguments, or none does. :meth:`Consumer._made` then claims the
bytes (:mod:`.regions`), registers the object with the view's failure owner
(:class:`.failure.ViewFailure`: it fails when the view is aborted) and names it to its torch
ops (:mod:`symmsync.ops.handles`, :attr:`Consumer.op_handle`).

Runs: :class:`Consumer` gives every consumer the same call path around its own launches:

* :meth:`Consumer.tensor_problem`: the one tensor rule (:func:`symmsync.checks.tensor_problem`)
  with the consumer's device and words; a call turns its arguments into a problem sentence.
* :meth:`Consumer.check_usable`: may a call run (buffer and object open, the object not
  failed, its view not aborted)?
* :meth:`Consumer.refuse`: a bad call on this member, before it launches: the object fails with
  :class:`~symmsync.InputError`, and the members' waits end with :class:`~symmsync.PeerAborted`
  naming this rank and the problem, instead of waiting out their budget.
* :meth:`Consumer.fail`: a launch raised, or a wait failed: the same, with that error.

Closed: ``close()`` / ``with`` / ``closed`` mean the same everywhere:

* ``close()`` is collective over the buffer's group, like construction (every rank closes its
  objects in the same order): every member's calls on the object are over first (GPUs: the
  device is synchronized; then a barrier over the group), then its claims go on every member
  at once (:func:`.agreement.release_together`), so that a new owner of any layout may be made
  at the same bytes right after, and no member's new owner can overwrite a slot a slow member
  still reads. The object's calls raise :class:`~symmsync.ClosedError` from then on; its view,
  its fence channel and the other objects on the view are untouched. Idempotent.
* ``with Consumer(...) as c:`` closes it at the block's end; a block left by an exception
  closes on this rank only, with no barrier (the other members may not have raised).
* An object dropped without ``close()`` still releases its bytes when it is collected (on each
  rank when its garbage goes; the next construction over them collects first).

A consumer that holds more than its claims (node steps, signal memory) overrides
:meth:`Consumer._release` and calls it.
"""

from __future__ import annotations

from typing import Any

from .. import backends
from ..checks import int_problem, tensor_problem
from ..errors import BoundsError, ClosedError, ConfigError, InputError
from ..language.cells import LINE
from ..ops import handles
from . import agreement
from .failure import used_after_abort
from .fence import Fence
from .regions import Region
from .views import PeerView


class Making:
    """One consumer's construction on this rank (the module's docstring shows the steps).

    Args:
        call: the consumer, as its messages name it (``"AllReduce"``, ``"moe.Dispatcher"``).
        view: its view.

    Raises at once (no exchange can be made): :class:`~symmsync.CaptureError` under compile
    (``backends.refuse_compiling``), :class:`~symmsync.ConfigError` for a ``view`` that is no
    :class:`~symmsync.PeerView`, :class:`~symmsync.ClosedError` for a closed buffer.

    Attributes:
        problem: the first problem this rank found (a sentence without the rank), or ``None``.
        error: the class it raises (:class:`~symmsync.ConfigError` or a subclass).
        regions: the byte ranges the object will claim (:meth:`claim`).
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
        is kept as one: agreed like the rest, so that every rank raises)."""
        if not self.ok:
            return None
        fence, problem, error = agreement.attempt(
            lambda: Fence(view or self.view, channel, timeout_s=timeout_s), self.buffer.rank
        )
        self.check(problem, error)
        return fence

    def claim(self, owner: str, start: int, stop: int, share: Any = None) -> Region | None:
        """The bytes ``[start, stop)`` the object will own (:class:`.regions.Region`; ``share``: the key of
        owners that may share them), checked against the buffer's owners now and claimed by
        :meth:`Consumer._made`; ``None`` where this rank has a problem."""
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
        return agreement.agree(
            buf.group, self.call, mine, problem=self.problem, error=self.error, same=same, device=buf.device
        )


class Consumer:
    """What every consumer of a view shares: how it is made, its calls' checks and failures, and
    its lifetime (the module's docstring).

    A subclass sets ``_NAME`` (how its messages name it) and calls :meth:`_made` once its
    :class:`Making` agreed; its calls ask :meth:`check_usable`, refuse bad arguments with
    :meth:`refuse`, and :meth:`fail` when a launch raised.
    """

    _NAME = "Consumer"
    _closed = False
    _claims: Any = ()
    _buffer: Any = None
    _channel = -1

    def _made(self, make: Making, where: str, *, memory: str, no_grad: str) -> None:
        """The construction agreed on every rank: claim its bytes, register with the view's failure
        owner as ``where`` (``"AllReduce (channel 0)"``), name the object to its torch ops.

        Args:
            make: the agreed construction.
            where: the object, as an abort it causes names it.
            memory: its memory, as a tensor refusal says where tensors must be (``"the
                collective's memory on cuda:0"``).
            no_grad: the call and its verb, as a refusal says it has no autograd formula
                (``"the collectives have"``).
        """
        buf, view = make.buffer, make.view
        self._buffer = buf
        self.view = view
        self._claims = tuple(buf.regions.claim(region, self) for region in make.regions)
        self._closed = False
        caps = buf.capabilities
        self._device_index = buf.device.index if caps.streams else -1  # Tensor.get_device() of its memory
        self._memory, self._no_grad = memory, no_grad
        self._failure = view.failure
        self._failure.register(self, where)
        self.op_handle = handles.register(self)
        """The int that names this object to its torch custom ops."""

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._buffer.rank

    # ------------------------------------------------------------------ a call's checks
    def tensor_problem(self, name: str, t: Any, **want: Any) -> str | None:
        """What is wrong with the tensor argument ``name`` of a call, or ``None``: the one rule of
        every consumer (:func:`symmsync.checks.tensor_problem`, whose keywords ``want`` takes: ``dtype``,
        ``shape``, ``numel``, ``shape_note``), on this consumer's device and in its words."""
        return tensor_problem(
            name, t, device_index=self._device_index, memory=self._memory, no_grad=self._no_grad, **want
        )

    def check_usable(self) -> None:
        """Raise if a call may not run: its buffer or the object is closed
        (:class:`~symmsync.ClosedError`), or the object failed (the first failed call's error,
        raised again), or this rank aborted its view (:class:`~symmsync.PeerAborted`). The
        view's failure owner decides, and aborts the view first (once) after a failure of this
        object's own, so that the members raise instead of waiting for it."""
        if self._buffer.closed:
            raise ClosedError(f"rank {self.rank}: {self._NAME}: used after its buffer was closed")
        if self._closed:
            raise ClosedError(
                f"rank {self.rank}: {self._NAME} (view {list(self.view.ranks)}) used after close(): make a new one"
            )
        self._failure.check(self)

    def refuse(self, problem: str, call: str = "", error: type = InputError) -> None:
        """Refuse a bad call on this member before it launches: the object fails with ``error``
        (raised here; a :class:`~symmsync.BoundsError` for an index out of range), and the members
        are told (:meth:`fail`). ``call``: the method, after the object's name in the message
        (``"dispatch"``)."""
        self.check_usable()  # an object that failed, or whose view was aborted, raises that first
        what = f"{self._NAME}.{call}" if call else self._NAME
        err = error(f"rank {self.rank}: {what}: {problem}")
        self.fail(err, f"{what}: {problem}")
        raise err

    def fail(self, err: Exception, reason: str | None = None) -> None:
        """This rank's call failed with ``err``: every later call raises ``err`` without launching,
        and the members' calls raise :class:`~symmsync.PeerAborted` naming this rank and ``reason``
        (default: the error's type and message), at once, instead of waiting out their budget for
        a call this rank never makes. ``err`` is recorded first: the abort then fails the view's
        other waiters, not this object, whose own error stays the first failure."""
        self._failure.fail(self, err)
        self._tell_members(reason or f"{self._NAME}: {type(err).__name__}: {err}"[:200], err)

    def _tell_members(self, reason: str, err: Exception) -> None:
        """How :meth:`fail` tells the members: abort the view (a consumer whose waits are on
        another view, such as the writer's fence over nodes, aborts that one instead)."""
        self._failure.abort_quietly(reason, cause=err)

    def abort_error(self, reason: str) -> Exception:
        """The :class:`~symmsync.PeerAborted` its calls raise once this rank aborted its view with
        ``reason`` (its part of :class:`.failure.Waiter`)."""
        return used_after_abort(self.view, self._NAME, reason, self._channel)

    # ------------------------------------------------------------------ lifetime
    def close(self, together: bool = True) -> None:
        """Release the object on every member at once (collective over the buffer's group, as its
        construction): every member's calls are over first, then its bytes are free on every
        member for a new owner of any layout; its calls raise :class:`~symmsync.ClosedError` from
        then on (:mod:`symmsync.core.consumer`). Idempotent.

        Args:
            together: ``False``: on this rank only, with no barrier (what a ``with`` block left by
                an exception does, when the other members may not come).

        Raises:
            BackendError: a member died or left before the barrier (the claims go all the same).
        """
        if self._closed:
            return
        self._closed = True
        self._release(together)

    def _release(self, together: bool) -> None:
        """Let go of what the object holds: its claims (together: after every member's calls are
        over). A consumer that holds more overrides this and calls it."""
        agreement.release_together(self._buffer, self._claims, together=together)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        self.close(together=kind is None)
