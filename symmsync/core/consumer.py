"""The consumer kit: how a consumer of a view (a collective, the direct-KV writer, the MoE
dispatcher, yours) is made, how its calls run and fail, and how it is closed. A consumer is its
kernels, its layout and its protocol; everything else is here, public, and the same for all.

Made: :class:`~symmsync.core.making.Making` checks this rank's arguments, claims bytes and
agrees once; :meth:`Consumer.made` finishes the construction on every rank: it claims the
bytes, registers the object with its view's failure owner, gives it its call headers
(:attr:`Consumer.calls`) and names it to its torch ops (:attr:`Consumer.op_handle`).

Runs: a call is its consumer's launches between :meth:`Consumer.start_call` and
:meth:`Consumer.finish_call` (one launch: :meth:`Consumer.run`)::

    bad = self.tensor_problem("x", x, dtype=self.dtype)  # this member's checks, as a sentence
    if bad is not None:
        x = self.nothing                                  # it sends nothing, and still takes part
    self.run(self.launch, x, out, x.numel(), problem=bad)

Every kernel of a call posts its header (kind, number, size words, refusal and reason) and
checks every member's after its wait (:mod:`symmsync.language.calls`): so a call one member
refuses, or that the members make differently, is found on every member inside the kernel,
which then reads nothing and stores its outputs' poison (NaN for floating outputs) instead, and
every member still takes part in its synchronization (the next call is in step). The host then
raises, on the host backend at the end of the call, on GPUs at :meth:`Consumer.synchronize`:

* on the refusing member, :class:`~symmsync.InputError` with its problem (at once);
* on the others, :class:`~symmsync.PeerRefused` naming it and its reason; the consumer goes on;
* on every member, the consumer's :attr:`Consumer.MISMATCH` (a :class:`~symmsync.CallMismatch`)
  when their calls differ; and a failed wait's error. Those fail the consumer: every later call
  raises the same error again (:meth:`Consumer.check_usable`).

Failing one call is the default: :meth:`Consumer.refuse` and ``run(..., problem=...)`` fail the
call on every member and leave the consumer and its view usable. Giving up on the view is a
separate act, :meth:`Consumer.abort`. A device-resident status word (:attr:`Consumer.status`)
says whether the calls since the host last settled went well, for a runtime to read with its
own device-to-host copies.

Closed: ``close()`` / ``with`` / ``closed`` mean the same everywhere:

* ``close()`` is collective over the buffer's group, like construction (every rank closes its
  objects in the same order): every member's calls on the object are over first (GPUs: the
  device is synchronized; then a barrier over the group), then its claims go on every member
  at once (:func:`.agreement.release_together`), so that a new owner of any layout may be made
  at the same bytes right after. The object's calls raise :class:`~symmsync.ClosedError` from
  then on; its view, its fence channel and the other objects on the view are untouched.
  Idempotent. Once the object or its view failed (a failed call, this rank's abort, a member's
  abort or death seen), ``close()`` releases this rank's part only, with no collective step: the
  members may be gone.
* ``with Consumer(...) as c:`` closes it at the block's end; a block left by an exception
  closes on this rank only, with no barrier, and never replaces the exception with an error of
  its own.
* An object dropped without ``close()`` still releases its bytes when it is collected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from ..checks import tensor_problem
from ..errors import (
    CallMismatch,
    ClosedError,
    FenceTimeout,
    InputError,
    SymmSyncError,
    peer_refused,
)
from ..language import calls as C
from ..ops import handles
from . import agreement
from . import launch as launches
from .calls import CallRecord, Calls
from .failure import Stall, used_after_abort
from .launch import BoundLaunch, Launcher, runtime_params
from .making import Making

__all__ = ["Consumer", "Making"]

log = logging.getLogger("symmsync")
T = TypeVar("T", bound="Consumer")


class Consumer:
    """What every consumer of a view shares: how it is made, how its calls run and fail, and its
    lifetime (the module's docstring).

    A subclass sets :attr:`NAME` (and :attr:`KINDS`, :attr:`WORDS` for its messages), makes itself
    with :class:`~symmsync.core.making.Making` and :meth:`made`, binds its kernels with :meth:`bind`
    and runs each call with :meth:`run` (or :meth:`start_call`, its launches, :meth:`finish_call`).
    Its hooks: :meth:`launch_refused` (what :meth:`refuse` launches), :meth:`describe_call` and
    :meth:`describe_refusal` (what its errors say), :meth:`release` (what ``close()`` lets go).

    Attributes:
        view: its view; ``buffer``: the view's buffer (set by :meth:`made`).
        calls: its call headers (:class:`~symmsync.core.calls.Calls`; ``None`` for a consumer made
            with ``calls=False``).
        waits: the fences and signals whose records :meth:`settle` reads.
        shares_gpu: the other members on this rank's GPU (several processes on one device).
        op_handle: the int that names the object to its torch ops (:meth:`from_handle`).
    """

    #: How the consumer's messages name it (``"AllReduce"``, ``"moe.Dispatcher"``).
    NAME = "Consumer"
    #: Its kinds of call, by the ``KIND`` its kernels post (messages name a call by its kind).
    KINDS: Sequence[str] = ("call",)
    #: The names of a call's four size words ``a`` .. ``d`` (``""``: unused), in its messages.
    WORDS: Sequence[str] = ("a", "b", "c", "d")
    #: What a refused call did, in the errors of a refusal.
    REFUSED_OUTCOME = "no member's call did anything (its outputs hold NaN), and the next call goes on"
    #: The error of members whose calls differ (a :class:`~symmsync.CallMismatch`).
    MISMATCH: type[CallMismatch] = CallMismatch

    view: Any = None
    buffer: Any = None
    device_index: int = -1
    calls: Calls | None = None
    waits: tuple[Any, ...] = ()
    shares_gpu: tuple[int, ...] = ()
    op_handle: int = 0
    _closed = False
    _claims: Any = ()
    _channel = -1

    # ------------------------------------------------------------------ made
    def made(self, make: Making, *, memory: str, no_grad: str, where: str | None = None, calls: bool = True) -> None:
        """Finish the construction on every rank, once ``make`` agreed (collective over the buffer's
        group): claim its bytes, register with the view's failure owner, make its call headers
        (collective), name the object to its torch ops.

        Args:
            make: the agreed construction.
            memory: where its tensors must be, as a refusal says it (``"the collective's memory on
                cuda:0"``).
            no_grad: the call and its verb, as a refusal says it has no autograd formula (``"the
                collectives have"``).
            where: the object, as an abort it causes names it (default: :attr:`NAME`).
            calls: make its call headers (:attr:`calls`); ``False`` for a consumer whose calls
                are made by other consumers (a collective over nodes, made of node steps).
        """
        buf, view = make.buffer, make.view
        self.buffer = buf
        self.view = view
        self._claims = tuple(buf.regions.claim(region, self) for region in make.regions)
        self._closed = False
        caps = buf.capabilities
        self.device_index = buf.device.index if caps.streams else -1
        """What ``Tensor.get_device()`` returns for a tensor on the consumer's device: the GPU's index,
        or -1 on the host backend (as for CPU and meta tensors: ask ``is_cpu`` there), for a call's
        checks of the common case in one expression."""
        self._kit_memory_words, self._kit_no_grad = memory, no_grad
        self._host_checks = caps.host_checks_status
        self._kit_launches: list[BoundLaunch] = []
        self.waits = tuple(make.waits)
        self.shares_gpu = make.shares_gpu
        self._failure = view.failure
        self._failure.register(self, where or self.NAME)
        if calls:
            self.calls = Calls(view, caps.pinned_record)
        self.op_handle = handles.register(self)

    @classmethod
    def from_handle(cls: type[T], handle: int) -> T:
        """The object of this class that ``handle`` (its :attr:`op_handle`) names: what a consumer's
        torch op looks up (:func:`symmsync.define_op`).

        Raises:
            ClosedError: the object was garbage-collected (a graph outlived it).
            ConfigError: ``handle`` names nothing, or an object of another class.
        """
        return handles.lookup(handle, cls)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.buffer.rank

    @property
    def status(self) -> Any:
        """This member's status word, on the device (int64, one element): 0 while every call since
        the host last settled (:meth:`settle`, :meth:`synchronize`) went well on every member, else
        1 (a member refused a call), 2 (the members' calls differed) or 3 (a wait failed): the
        earliest failed call's. Read it with the runtime's own device-to-host copy, beside what a
        step returns, to know that its outputs are good without a synchronization
        (docs/concepts.md, "The status word")."""
        return None if self.calls is None else self.calls.status

    # ------------------------------------------------------------------ binding launches
    def bind(
        self,
        kernel: Any,
        *,
        grid: Sequence[int] = (1,),
        per_call: Sequence[str] = (),
        num_warps: int = 4,
        **args: Any,
    ) -> BoundLaunch:
        """A launch of ``kernel`` with its arguments bound by name, packed once: each call passes the
        ``per_call`` parameters only, and :meth:`run` appends ``refused`` (the call's refusal code).

        Args:
            kernel: a ``@triton.jit`` kernel (or a :class:`~symmsync.core.launch.Launcher` of one).
            grid: the launch's grid.
            per_call: the parameters each call passes, in that order (``refused`` is added last
                when the kernel has a parameter of that name).
            num_warps: warps per program.
            **args: every other parameter by name, its compile-time constants too; ``calls`` is
                filled in (the object's call handle) when the kernel has it and it is not given.

        Raises:
            BackendError: a parameter has no value, or a name is not the kernel's.
        """
        if isinstance(kernel, Launcher):
            launcher = kernel
        else:
            _runtime, consts = runtime_params(kernel)
            launcher = Launcher(kernel, grid, num_warps, **{k: args.pop(k) for k in consts if k in args})
        if "calls" in launcher.names and "calls" not in args and self.calls is not None:
            args["calls"] = self.calls.kernel_args[0]
        per = tuple(per_call)
        if "refused" in launcher.names and "refused" not in per:
            per = (*per, "refused")
        bound = launcher.bind_named(grid=grid, per_call=per, **args)
        self._kit_launches.append(bound)
        return bound

    def device_programs(self, per_sm: int, interpreted: int) -> int:
        """The programs of a launch sized by the device: ``per_sm`` for each multiprocessor it
        reports (under MPS, its share's), or ``interpreted`` under Triton's interpreter."""
        return launches.device_programs(self.buffer.device, per_sm, interpreted)

    # ------------------------------------------------------------------ a call
    def tensor_problem(self, name: str, t: Any, **want: Any) -> str | None:
        """What is wrong with the tensor argument ``name`` of a call, or ``None``: the one rule of
        every consumer (:func:`symmsync.checks.tensor_problem`, whose keywords ``want`` takes: ``dtype``,
        ``shape``, ``numel``, ``shape_note``, ``apart``), on this consumer's device and in its words."""
        return tensor_problem(
            name, t, device_index=self.device_index, memory=self._kit_memory_words, no_grad=self._kit_no_grad, **want
        )

    def check_usable(self) -> None:
        """Raise if a call may not run: its buffer or the object is closed
        (:class:`~symmsync.ClosedError`), or the object failed (the first failed call's error,
        raised again), or this rank aborted its view (:class:`~symmsync.PeerAborted`). The
        view's failure owner decides, and aborts the view first (once) after a failure of this
        object's own, so that the members raise instead of waiting for it."""
        if self.buffer.closed:
            raise ClosedError(f"rank {self.rank}: {self.NAME}: used after its buffer was closed")
        if self._closed:
            raise ClosedError(
                f"rank {self.rank}: {self.NAME} (view {list(self.view.ranks)}) used after close(): make a new one"
            )
        self._failure.check(self)

    def start_call(self, problem: str | None = None) -> int:
        """Begin a call, before its launches: raise if it may not run (:meth:`check_usable`), and
        return its refusal code for the kernels' ``refused``: 0, or
        :data:`~symmsync.language.calls.REFUSED_HOST` with ``problem`` staged as this member's
        reason (the call is made all the same, with nothing to send: pass the kernels inputs that
        send nothing)."""
        if problem is None:
            if self._closed or not self._failure.clean:  # a closed buffer's views are never clean
                self.check_usable()
            return C.REFUSED_NONE
        self.check_usable()
        self.calls.stage(problem)
        return C.REFUSED_HOST

    def finish_call(self, problem: str | None = None, call: str = "", error: type = InputError) -> None:
        """End a call, after its launches: where launches have finished when they return (the host
        backend) raise what the call found (:meth:`settle`); then, for a refused call
        (``problem``), this member's own ``error`` (:meth:`refusal`)."""
        if self._host_checks:
            self.settle()
        if problem is not None:
            raise self.refusal(problem, call, error)

    def run(
        self, launch: BoundLaunch, *values: Any, problem: str | None = None, call: str = "", error: type = InputError
    ) -> None:
        """One call of one launch: :meth:`start_call`, ``launch(*values, refused)``, :meth:`finish_call`.

        With ``problem`` (this member's checks refused its arguments) the call is made all the same,
        refused: pass ``values`` that send nothing. It fails on every member and nothing else: this
        member raises ``error`` (:class:`~symmsync.InputError`), the others
        :class:`~symmsync.PeerRefused` naming it and ``problem``; every member's outputs of the call
        hold the consumer's poison, and the next call goes on. A launch that raises fails the
        consumer (:meth:`fail`): it may have run in part.
        """
        refused = self.start_call(problem)
        try:
            launch(*values, refused)
        except Exception as e:
            self.fail(e)
            raise
        self.finish_call(problem, call, error)

    def refuse(self, problem: str, call: str = "", error: type = InputError) -> None:
        """Fail this call on every member, and nothing else: the default way to refuse a bad call.

        This member still makes the call, with nothing to send and its header refused
        (:meth:`launch_refused`), so that every member's call ends at once and the next is in
        step; it raises ``error`` here, and the others raise :class:`~symmsync.PeerRefused` naming
        it and ``problem`` (on GPUs at :meth:`synchronize`). A consumer without
        :meth:`launch_refused` cannot fail one call: its view is aborted instead (every member's
        call raises :class:`~symmsync.PeerAborted` naming this rank), and the error says so.
        """
        refused = self.start_call(problem)
        try:
            self.launch_refused(call, refused)
        except NotImplementedError:
            err = self.refusal(problem, call, error)
            err.args = (f"{err.args[0]} ({self.NAME} defines no launch_refused(): its view was aborted)",)
            self.fail(err, f"{self.NAME}: {problem}"[:200])
            raise err from None
        except SymmSyncError:  # what the launch found (its consumer settled it), or failed with (it failed)
            raise
        except Exception as e:
            self.fail(e)
            raise
        self.finish_call(problem, call, error)

    def launch_refused(self, call: str, refused: int) -> None:
        """Hook of :meth:`refuse`: launch the call named ``call`` with nothing to send, passing its
        kernels ``refused`` (the refusal code; the reason is staged). A consumer that runs every call
        through :meth:`run` refuses with ``run(..., problem=...)`` instead and need not define it."""
        raise NotImplementedError

    def refusal(self, problem: str, call: str = "", error: type = InputError) -> SymmSyncError:
        """The error a refused call raises on the member that refused it."""
        what = f"{self.NAME}.{call}" if call else self.NAME
        return error(f"rank {self.rank}: {what}: {problem}; {self.REFUSED_OUTCOME}")

    # ------------------------------------------------------------------ what a call found
    def settle(self, synchronize: bool = False) -> None:
        """Raise what the consumer's calls left on the device, once: a failed wait of its
        :attr:`waits`, or the earliest failed call its state kept (:meth:`call_error`). Members'
        calls that differed, or a failed wait, fail the consumer; a refusal fails the call only.

        Args:
            synchronize: wait for the device first (GPUs; :meth:`synchronize`). Where ranks share
                one GPU, the wait ends as soon as a record holds an error, or after twice the
                budget with a :class:`~symmsync.FenceTimeout` saying the device may be stuck.
        """
        stall = self._stall() if synchronize and self.shares_gpu else None
        self._failure.settle(self, self._wait_error, synchronize=synchronize, stall=stall)
        if self.calls is None or not self.calls.failed():
            return
        rec = self.calls.take()
        err = self.call_error(rec)
        if rec.status != C.REFUSED:
            self._failure.fail(self, err)
        raise err

    def synchronize(self) -> None:
        """Wait for the device, then raise what the calls since the last settle found
        (:meth:`settle`): on GPUs a call's failure is known here, not when the call returns."""
        self.check_usable()
        self.settle(synchronize=True)

    def _wait_error(self) -> SymmSyncError | None:
        # The records of the consumer's waits (pinned host memory on GPUs: safe to read while the
        # device runs), the first one that holds an error.
        for wait in self.waits:
            err = wait.timeout_error()
            if err is not None:
                return self._on_shared_gpu(err)
        return None

    def _on_shared_gpu(self, err: Exception) -> Exception:
        if self.shares_gpu and err.args:
            err.args = (f"{err.args[0]} ({shared_gpu_note(self.rank, self.shares_gpu)})", *err.args[1:])
        return err

    def _stall(self) -> Stall:
        budget = max((getattr(w, "timeout_s", 0.0) for w in self.waits), default=60.0)
        after_s = 2 * budget + 30.0
        return Stall(after_s, lambda: stalled_error(self.rank, self.NAME, self.view.ranks, self.shares_gpu, after_s))

    def call_error(self, rec: CallRecord) -> SymmSyncError:
        """The error of the failed call ``rec`` (what :meth:`settle` raises)."""
        ranks, me = self.view.ranks, self.rank
        kind = self.KINDS[rec.kind] if 0 <= rec.kind < len(self.KINDS) else f"call of kind {rec.kind}"
        what = self.NAME if kind == "call" else f"{self.NAME}.{kind}"
        later = f" ({rec.later} later call{'s' if rec.later > 1 else ''} failed too)" if rec.later else ""
        if rec.status == C.REFUSED:
            code, where, value, text = rec.refusal(rec.who)
            reason = text if code == C.REFUSED_HOST else self.describe_refusal(code, where, value)
            origin = ranks[rec.who]
            if origin == me:  # found by this member's own kernel
                found = f"found by its kernel, call {rec.number}"
                return InputError(f"rank {me}: {what}: {reason} ({found}); {self.REFUSED_OUTCOME}{later}")
            return peer_refused(
                me, what, ranks, f"call {rec.number}", origin, kind, reason, self.REFUSED_OUTCOME + later
            )
        if rec.status == C.MISMATCH:
            return self._mismatch(rec, what, later)
        return self._on_shared_gpu(
            FenceTimeout(
                f"rank {me}: {what} on view {list(ranks)} (call {rec.number}): a wait of the call failed, and its "
                f"record holds no error; nothing after it ran{later}",
                rank=me,
                epoch=rec.number,
                late={},
                channel=self._channel,
            )
        )

    def _mismatch(self, rec: CallRecord, what: str, later: str) -> CallMismatch:
        ranks = self.view.ranks
        calls = {ranks[m]: self.describe_call(h, rec.number) for m, h in enumerate(rec.headers)}
        fields = list(dict.fromkeys(f for c in calls.values() for f in c))
        differs = [f for f in fields if len({repr(c.get(f)) for c in calls.values()}) > 1]
        parts = [f"{f}: " + ", ".join(f"rank {r}: {c.get(f, '-')}" for r, c in calls.items()) for f in differs]
        msg = (
            f"rank {self.rank}: {what} on view {list(ranks)} (call {rec.number}): the members' calls differ "
            f"({'; '.join(parts)}). Every member must make the same calls, with the same sizes, in the same order; "
            f"nothing of the call was read, and {self.NAME} fails from now on{later}"
        )
        return self.MISMATCH(msg, rank=self.rank, number=rec.number, calls=calls, differs=differs, other=ranks[rec.who])

    def describe_call(self, header: list[int], number: int) -> dict[str, Any]:
        """A member's header of a call, in words (what a mismatch's error shows): its kind, its
        size words by :attr:`WORDS`, and whether it is this call. Override to word the size words."""
        kind = header[C.H_TAG] - C.TAG
        if not 0 <= kind < len(self.KINDS):
            return {"call": "none (no call of this consumer's at this number)"}
        out: dict[str, Any] = {"call": self.KINDS[kind]}
        for name, value in zip(self.WORDS, header[C.H_A : C.H_D + 1]):
            if name:
                out[name] = value
        n = header[C.H_NUMBER]
        out["number"] = "this call" if n == number else f"call {n}"
        return out

    def describe_refusal(self, code: int, where: int, value: int) -> str:
        """A refusal its kernels found (``code`` from :data:`~symmsync.language.calls.REFUSED_DEVICE` up,
        with ``where`` and ``value``), in words. Override to word the consumer's own codes."""
        return f"its kernel refused the call (code {code}, at {where}: {value})"

    # ------------------------------------------------------------------ failure
    def fail(self, err: Exception, reason: str | None = None) -> None:
        """This rank's call failed with ``err`` (a launch raised: it may have run in part): every
        later call raises ``err`` without launching, and the view is aborted (:meth:`abort`), so
        that the members' calls raise :class:`~symmsync.PeerAborted` naming this rank and
        ``reason`` (default: the error's type and message) at once, instead of waiting out their
        budget for a call this rank never makes."""
        self._failure.fail(self, err)
        try:
            self.abort(reason or f"{self.NAME}: {type(err).__name__}: {err}"[:200], cause=err)
        except SymmSyncError:  # a closed buffer's error says enough
            pass

    def abort(self, reason: str, cause: Exception | None = None) -> None:
        """Give up on the consumer's view (a separate, named act: a refused call does not): every
        member's waits on it end at once with :class:`~symmsync.PeerAborted` naming this rank and
        ``reason`` (:meth:`symmsync.PeerView.abort`); every consumer on the view fails.
        ``cause``: the error that made this rank give up (one that names another member's abort
        is relayed, naming that member)."""
        self._failure.abort_quietly(reason, cause=cause)

    def abort_error(self, reason: str) -> Exception:
        """The :class:`~symmsync.PeerAborted` its calls raise once this rank aborted its view with
        ``reason`` (the view's failure owner asks it)."""
        return used_after_abort(self.view, self.NAME, reason, self._channel)

    # ------------------------------------------------------------------ lifetime
    def close(self, together: bool = True) -> None:
        """Release the object on every member at once (collective over the buffer's group, as its
        construction): every member's calls are over first, then its bytes are free on every
        member for a new owner of any layout; its calls raise :class:`~symmsync.ClosedError` from
        then on (:mod:`symmsync.core.consumer`). Idempotent.

        Args:
            together: ``False``: on this rank only, with no collective step (what a ``with`` block
                left by an exception does, when the other members may not come). Once the object
                or its view failed (a failed call, this rank's abort, a member's abort or death
                seen) it is this rank's part only, whatever ``together`` says.

        Raises:
            BackendError: a member died or left before the barrier (the claims go all the same).
        """
        if self._closed:
            return
        self._closed = True
        if self.view is not None and (self.view.aborted is not None or self._failure.error_of(self) is not None):
            together = False  # the view or the object failed: the members may be gone
        self.release(together)

    def release(self, together: bool) -> None:
        """What :meth:`close` lets go: the claims (``together``: after every member's calls are
        over), the call headers, the bound launches. A consumer that holds more (signal memory, node
        steps) overrides this and calls it."""
        try:
            if self.buffer is not None:
                agreement.release_together(self.buffer, self._claims, together=together)
        finally:
            self.release_tables()
            if self.calls is not None:
                self.calls.close()

    def release_tables(self) -> None:
        """Drop the buffer's tables the object holds (its bound launches' fixed arguments): the
        buffer's ``close()`` calls it through the view's failure owner, so that only what users
        kept holds the mappings. Its calls raise :class:`~symmsync.ClosedError` from then on."""
        for launch in self._kit_launches if self.buffer is not None else ():
            launch.release()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        if kind is None:
            self.close()
            return
        try:
            self.close(together=False)
        except Exception as e:  # noqa: BLE001 - the exception in flight is the one to see
            log.warning("%s: close() after %s raised %s: %s", self.NAME, kind.__name__, type(e).__name__, e)


# ---------------------------------------------------------------------- members sharing one GPU
def shared_gpu_note(rank: int, others: Sequence[int]) -> str:
    """What every error of a member that shares its GPU with ``others`` adds (docs/gpu.md)."""
    return (
        f"rank {rank} shares its GPU with rank(s) {', '.join(map(str, others))}: a trap in one of their CUDA "
        "contexts can leave another's torch.cuda.synchronize() blocked for good, and this CUDA context may be "
        "unusable; run one rank per GPU"
    )


def stalled_error(rank: int, name: str, ranks: Sequence[int], others: Sequence[int], waited_s: float) -> FenceTimeout:
    """The error of ``rank``'s ``synchronize()`` on a shared GPU that saw neither the device finish
    nor a failure recorded within ``waited_s`` (``others``: the members sharing its GPU)."""
    return FenceTimeout(
        f"rank {rank}: {name} on view {list(ranks)}: synchronize() waited {waited_s:g} s, and neither did the "
        f"device finish nor did a call record a failure ({shared_gpu_note(rank, others)})",
        rank=rank,
        epoch=-1,
        late={},
        channel=-1,
    )
