"""Expert-parallel dispatch and combine over a peer view: the host side.

A :class:`Dispatcher` is made with the consumer kit (:mod:`symmsync.core.consumer`) and owns a
workspace in the view's buffer (:mod:`.layout`) and a :class:`~symmsync.Signals` object of one
slot; a dispatch or a combine is two bound launches (:mod:`.kernels`, in the order of
:mod:`.protocol`), with no host synchronization and no host barrier between calls. A dispatch
moves each row once, into the receiver's workspace, where its ``recv`` is a view. A bad
argument fails the call on every member and nothing else; steps that differ fail the dispatcher.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ..backends import mode, part_of
from ..core.consumer import Consumer
from ..core.launch import BoundLaunch, Launcher, kernel_view
from ..core.making import Making
from ..core.nodes import spanning_problem
from ..core.signals import Signals
from ..core.views import PeerView
from ..errors import CallMismatch, ConfigError
from . import kernels, protocol
from . import layout as L

#: The most entries per token (``top_k``) a dispatcher takes.
MAX_TOP_K = 32
_CHUNK = 2048  # channels of a row a program moves (at most): rows x chunks spread a step's programs
_ROWS = 4  # received rows a program of a combine's send moves at a time
#: The default of ``programs`` per multiprocessor, a dispatch's and a combine's (under Triton's interpreter: in
#: all): tuning knobs, every value gives the same bytes. The combine's 4: the fastest in each of three rounds of
#: a sweep of 1, 2, 4, 8, 16 at worlds 2, 4, 8 on one H100 (docs/performance.md); the dispatch's was indifferent.
PROGRAMS_PER_SM, COMBINE_PROGRAMS_PER_SM, PROGRAMS_INTERPRETED = 2, 4, 4
PHASE_TIMES_ENV = "SYMMSYNC_MOE_PHASE_TIMES"
_NO_GRAD = "dispatch and combine have"  # no autograd formula (symmsync.checks.tensor_problem words it)


class StepMismatch(CallMismatch):
    """The members of a dispatcher made different steps (one a dispatch, another a combine, or
    their counts of steps differ): raised on every member, before anything of the step was read.
    A :class:`~symmsync.CallMismatch` (``other``: the global rank of the member whose step
    differed first); the dispatcher fails."""


class Pending:
    """A step whose send is launched and whose receive is not yet (``dispatch(..., wait=False)``,
    ``combine(..., wait=False)``): launch other work, then call :meth:`wait` once, before any
    other call of the dispatcher, to launch the receive and get the call's results.

    Between the two the rows travel while the stream runs what was launched in between (an
    expert's GEMM, attention): a dispatch's send waits only for every member's counts, a
    combine's for nothing; the rows are awaited in the receive. Both are ordinary kernel launches:
    a CUDA graph captures the pair and what lies between them like any other launches.
    """

    def __init__(self, finish: Any, what: str, rank: int):
        self._finish = finish
        self.what = what
        """The pending step's kind (``"dispatch"``, ``"combine"``)."""
        self.rank = rank
        self.done = False
        """True once :meth:`wait` ran."""

    def wait(self) -> Any:
        """Launch the step's receive and return what the call returns with ``wait=True`` (raising
        what it raises); a second call raises :class:`~symmsync.ConfigError`."""
        if self.done:
            raise ConfigError(
                f"rank {self.rank}: moe.Dispatcher: the pending {self.what}'s wait() was called already: "
                "its results are what that call returned"
            )
        self.done = True
        return self._finish()


class Handle(NamedTuple):
    """What a dispatch hands its combine: where each received row came from.

    Attributes:
        topk_idx: the routing this member dispatched (``[tokens, top_k]``, int64).
        src: ``[local experts, members * max_tokens]`` int64: for received row ``offsets[e][s] + j``
            of local expert ``e``, ``t * top_k + k`` (token ``t`` of member ``s``, its entry ``k``);
            past ``counts[e]`` not written. A view of the dispatcher's workspace, as ``recv``: it
            holds until this member's dispatch after next (:meth:`Dispatcher.dispatch`).
        per_source: ``[local experts, members]`` int64: the rows each member sent each local expert
            (-1 everywhere after a failed dispatch: its combine then sends nothing and returns NaN).
        offsets: ``[local experts, members]`` int64: where member ``s``'s rows start among local
            expert ``e``'s received rows (the sum of ``per_source[e][:s]``).
    """

    topk_idx: torch.Tensor
    src: torch.Tensor
    per_source: torch.Tensor
    offsets: torch.Tensor


def _wait_problem(wait: Any) -> str | None:
    """What is wrong with a call's ``wait`` (a bool), or ``None``."""
    return None if isinstance(wait, bool) else f"wait must be True or False, got {wait!r}"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Dispatcher(Consumer):
    """Send each token to the members that own its top-k experts, and bring the outputs back.

    Args:
        view: the members (a :class:`~symmsync.PeerView` within one node). Member ``m`` owns
            the experts ``[m * E / W, (m + 1) * E / W)`` (``E`` = ``num_experts``, ``W`` = members).
        num_experts: experts in all, a multiple of the view's size.
        max_tokens: the most tokens a member dispatches in one call.
        hidden: elements of a token's row (with ``fp8``: a multiple of 128).
        dtype: the rows' element type (``torch.bfloat16``, ``torch.float16`` or ``torch.float32``):
            the tokens' and the experts' outputs'.
        top_k: entries per token in ``topk_idx`` (1 to :data:`MAX_TOP_K`).
        fp8: dispatch e4m3 codes with a float32 scale per 128 channels (:data:`~symmsync.moe.layout.FP8_RULE`)
            instead of the rows; the combine still takes ``dtype`` rows.
        offset: where the workspace starts in the view's buffer (a multiple of 128;
            :func:`~symmsync.moe.buffer_bytes` says how much it takes).
        timeout_s: wait budget of every wait (default: the buffer's).
        programs: the programs of the launches sized by the device (a dispatch's send, a
            combine's send, a combine's sum; each program waits once, then loops over its share).
            Default: :data:`PROGRAMS_PER_SM` (a combine's: :data:`COMBINE_PROGRAMS_PER_SM`) for
            each multiprocessor the device reports (under MPS, its share's);
            :data:`PROGRAMS_INTERPRETED` on the host backend. A tuning knob: every value gives the
            same bytes.

    Made collectively, before compile and capture: every rank of the buffer's group constructs
    its object at the same time, the members of the view with the same arguments, or every
    rank raises :class:`~symmsync.ConfigError` (:class:`~symmsync.BoundsError` when the
    workspace does not fit).

    Example::

        buf = ss.SymmetricBuffer(moe.buffer_bytes(E, M, h, torch.bfloat16, k, world))
        disp = moe.Dispatcher(buf.view(list(range(world))), E, M, h, torch.bfloat16, k)
        recv, counts, handle = disp.dispatch(x, topk_idx)
        y = disp.combine(experts(recv, counts), topk_weights, handle)
    """

    NAME = "moe.Dispatcher"
    KINDS = ("dispatch", "combine")  # by the kind a step's header carries (protocol.DISPATCH, COMBINE)
    MISMATCH = StepMismatch
    REFUSED_OUTCOME = (
        "no member's step did anything (its counts are 0, its rows and a combine's NaN), and the next call goes on"
    )

    def __init__(
        self,
        view: PeerView,
        num_experts: int,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype,
        top_k: int,
        *,
        fp8: bool = False,
        offset: int = 0,
        timeout_s: float | None = None,
        programs: int | None = None,
    ):
        make = Making(self.NAME, view)
        buf = make.buffer
        make.check(spanning_problem(view.nodes, "a moe.Dispatcher"))
        make.ints(
            num_experts=(num_experts, 1, None),
            max_tokens=(max_tokens, 1, None),
            hidden=(hidden, 1, None),
            top_k=(top_k, 1, MAX_TOP_K),
        )
        if programs is not None:
            make.ints(programs=(programs, 1, None))
        if make.ok and num_experts % view.size:
            make.check(
                f"num_experts={num_experts} is not a multiple of the view's {view.size} members "
                "(each member owns num_experts / members experts)"
            )
        if make.ok and top_k > num_experts:
            make.check(f"top_k={top_k} is more than num_experts={num_experts}")
        if make.ok and dtype not in L.DTYPES:
            make.check(f"dtype must be one of {', '.join(map(str, L.DTYPES))}, got {dtype!r}")
        if make.ok and not isinstance(fp8, bool):
            make.check(f"fp8 must be a bool, got {fp8!r}")
        if make.ok and fp8 and hidden % L.FP8_GROUP:
            make.check(f"with fp8, hidden must be a multiple of {L.FP8_GROUP} (a scale per 128 channels), got {hidden}")
        ws = None
        if make.offset(offset):
            ws = L.Workspace.plan(offset, num_experts, view.size, max_tokens, hidden, dtype, top_k, fp8)
            make.fits(offset, ws.nbytes, "allocate symmsync.moe.buffer_bytes(...) more, or lower max_tokens")
            make.claim(f"{self.NAME} (view {list(view.ranks)})", offset, offset + ws.nbytes)  # shared with none
        make.agree(
            {
                "num_experts": num_experts,
                "max_tokens": max_tokens,
                "hidden": hidden,
                "the dtype": str(dtype),
                "top_k": top_k,
                "fp8": fp8,
                "the offset": offset,
                "timeout_s": timeout_s,
                "programs": programs,
            }
        )
        memory = f"the dispatcher's memory on {buf.device}"
        self.made(make, where=f"{self.NAME} (view {list(view.ranks)})", memory=memory, no_grad=_NO_GRAD)
        self.sigs = Signals(view, slots=protocol.SLOTS, timeout_s=timeout_s)
        """The :class:`~symmsync.Signals` object the steps signal and wait on (its one slot counts them)."""
        self.waits = (*self.waits, self.sigs)  # a failed wait's record: what settle() reads first
        self.view = view
        self.size = view.size
        self.num_experts = num_experts
        self.local_experts = num_experts // view.size
        """Experts this member owns: ``[rank_in_view * local_experts, (rank_in_view + 1) * local_experts)``."""
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.dtype = dtype
        self.top_k = top_k
        self.fp8 = fp8
        self.workspace = ws
        """Where the dispatcher's bytes live in every member (:class:`~symmsync.moe.layout.Workspace`)."""
        caps = buf.capabilities
        self._device = buf.device
        self._interp = mode.kernels_interpreted()
        self._bits = self._interp and dtype is torch.bfloat16
        # the steps' own words (protocol.py), on the device; their headers and outcomes are the kit's
        self._state = torch.zeros(protocol.STATE_WORDS, dtype=torch.int64, device=buf.device)
        # a dispatch's counts, added up by its send's first-ticket program and read back as zeros (kernels._counts)
        self._tally = torch.zeros(num_experts, dtype=torch.int32, device=buf.device)
        self._dispatches = 0  # dispatches launched: the next one's buffer is this modulo 2 (layout.py)
        self._live: list[int] = []  # the last two dispatches' per_source: the handles whose rows still hold
        timed = os.environ.get(PHASE_TIMES_ENV) == "1"  # a profiling switch: kernels.py's _stamp
        self.phase_times = torch.zeros(8 if timed else 1, dtype=torch.int64, device=buf.device)
        """The last dispatch's clock stamps (ns) with ``SYMMSYNC_MOE_PHASE_TIMES=1`` at construction."""
        self._groups = hidden // L.FP8_GROUP if fp8 else 1
        self._chunks = -(-hidden // min(_pow2(hidden), _CHUNK))  # a send's (or reduce's) programs per row
        # The programs of a launch sized by the device (few wait, few find nothing to do); each loops
        # over its share (a combine's send's, a few per local expert and source, over blocks of rows).
        self.programs = programs or self.device_programs(PROGRAMS_PER_SM, PROGRAMS_INTERPRETED)
        """The programs of a dispatch's send (the ``programs`` argument, or its default)."""
        self.combine_programs = programs or self.device_programs(COMBINE_PROGRAMS_PER_SM, PROGRAMS_INTERPRETED)
        """The programs of a combine's launches (the ``programs`` argument, or its default)."""
        row_blocks = -(-max_tokens // _ROWS)  # blocks of rows a source may send an expert
        self._blocks = max(1, min(row_blocks, -(-self.combine_programs // (self.local_experts * view.size))))
        self._launches = self._launchers(caps.traps)
        dev, i64 = buf.device, torch.int64
        # What a dispatch into buffer b returns (recv, scales, src): views of the workspace, made once
        self._buffers = tuple(self._views(b) for b in range(2))
        # What a refused step launches with: no tokens, no rows (its header says why).
        self._no_tokens = (
            torch.empty((0, hidden), dtype=dtype, device=dev),
            torch.empty((0, top_k), dtype=i64, device=dev),
        )
        per = torch.zeros((self.local_experts, view.size), dtype=i64, device=dev)
        rows = view.size * max_tokens
        self._no_outputs = (
            torch.empty((self.local_experts, rows, hidden), dtype=dtype, device=dev),
            torch.empty((0, top_k), dtype=torch.float32, device=dev),
            Handle(self._no_tokens[1], torch.zeros((self.local_experts, rows), dtype=i64, device=dev), per, per),
        )
        self._bound: dict[tuple, BoundLaunch] = {}  # (kernel, grid, buffer) -> its launch, packed once
        self._pending: Pending | None = None  # a step launched with wait=False, until its wait()

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        """``(recv, scales, src)`` over this member's dispatch buffer ``b`` (``scales`` empty without
        fp8), each with a storage of its own over its bytes: an op's returns share no storage."""
        ws, el, rows = self.workspace, self.local_experts, self.size * self.max_tokens
        parts = (
            (ws.rows, (el, rows, self.hidden), torch.float8_e4m3fn if self.fp8 else self.dtype),
            (ws.scales, (el, rows, self._groups) if self.fp8 else (0,), torch.float32),
            (ws.src, (el, rows), torch.int64),
        )
        views = [self.view.tensor(offset + b * ws.dispatch_stride, shape, dtype) for offset, shape, dtype in parts]
        return tuple(part_of(t, 0, t.numel() * t.element_size()).view(t.dtype).view(t.shape) for t in views)

    def _launchers(self, traps: bool) -> dict[str, tuple[Launcher, dict[str, Any], tuple[str, ...]]]:
        """Each kernel's launcher, its fixed arguments by name, and the names a call passes."""
        ws, size, el, h = self.workspace, self.size, self.local_experts, self.hidden
        sig, me, timeout_ns, record = self.sigs.kernel_args
        hb = min(_pow2(h), _CHUNK)
        steps = dict(state=self._state, sig=sig, me=me)
        waits = dict(steps, timeout_ns=timeout_ns, record=record)
        stamps = dict(times=self.phase_times)
        tally = dict(tally=self._tally)
        both = dict(TIMES=self.phase_times.numel() > 1, SP=_pow2(size), TRAP=traps, E=self.num_experts, EL=el)
        counts = dict(counts_off=ws.counts, counts_stride=ws.counts_stride, rows_off=ws.rows)
        rows = dict(scales_off=ws.scales, src_off=ws.src)
        tokens = dict(BT=_pow2(self.max_tokens), KP=_pow2(self.top_k), EP=_pow2(self.num_experts))
        combine = dict(comb_off=ws.combine, stride=ws.combine_stride)
        sync = dict(SIZE=size, NSLOTS=protocol.SLOTS)
        exact = {} if self._interp else {"enable_fp_fusion": False}  # the documented order, no FMA
        return {
            "dispatch_send": (
                Launcher(
                    kernels.dispatch_send, (1,), 4, **sync, **both, M=self.max_tokens, H=h, HB=hb, C=self._chunks,
                    TOPK=self.top_k, **tokens, FP8=self.fp8, GB=max(1, hb // L.FP8_GROUP), BITS=self._bits,
                ),
                dict(waits, **counts, **rows, **stamps, **tally),
                ("x", "topk", "T", "refused"),
            ),
            "dispatch_recv": (
                Launcher(kernels.dispatch_recv, (1,), 4, **sync, **both, ELP=_pow2(el)),
                dict(waits, **counts, **stamps),
                ("counts_out", "per_source", "offsets"),
            ),
            "combine_send": (
                Launcher(kernels.combine_send, (1,), 4, **sync, M=self.max_tokens, H=h, HP=_pow2(h), RB=_ROWS),
                dict(steps, **combine),
                ("out", "per_source", "offsets", "src", "refused"),
            ),
            "combine_reduce": (
                Launcher(
                    kernels.combine_reduce, (1,), 4, **sync, TRAP=traps, E=self.num_experts, H=h, HB=hb,
                    C=self._chunks, TOPK=self.top_k, BITS=self._bits, **exact,
                ),
                dict(waits, **combine),
                ("y", "topk", "weights", "T", "per_source"),
            ),
        }  # fmt: skip

    def _launch(self, name: str, grid: tuple[int, int, int], b: int, *values: Any) -> None:
        """Launch kernel ``name`` on ``grid`` (a dispatch's: into buffer ``b``; else ``b`` is -1) with a
        call's ``values`` (its bound launch, packed at its first call: a later call repacks only what
        changed); a launch that raised fails the dispatcher (it may have run in part)."""
        bound = self._bound.get((name, grid, b))
        if bound is None:
            launcher, fixed, per_call = self._launches[name]
            at = max(b, 0) * self.workspace.dispatch_stride  # buffer b's regions: buffer 0's, moved
            fixed = {k: v + at if k in ("rows_off", "scales_off", "src_off") else v for k, v in fixed.items()}
            bound = self._bound[(name, grid, b)] = self.bind(launcher, grid=grid, per_call=per_call, **fixed)
        try:
            bound(*values)
        except Exception as e:
            self.fail(e)
            raise

    def check_usable(self) -> None:
        """:meth:`symmsync.core.consumer.Consumer.check_usable`, and no step pending: a call made
        before a pending step's ``wait()`` raises :class:`~symmsync.ConfigError`, launching nothing."""
        super().check_usable()
        pending = self._pending
        if pending is not None and not pending.done:
            raise ConfigError(
                f"rank {self.rank}: moe.Dispatcher: a {pending.what} launched with wait=False is pending: call its "
                "wait() before the dispatcher's next call"
            )

    def describe_refusal(self, code: int, where: int, value: int) -> str:
        """An expert id its send found out of range (:data:`.protocol.REFUSED_EXPERT_ID`), in words."""
        t, k = divmod(where, self.top_k)
        return (
            f"topk_idx[{t}, {k}] = {value} is no expert id: ids run from 0 to {self.num_experts - 1} "
            f"(num_experts={self.num_experts}), -1 masks an entry"
        )

    # ------------------------------------------------------------------ checks
    def _ids_problem(self, topk_idx: torch.Tensor) -> str | None:
        """What is wrong with the values of ``topk_idx`` (ids from -1 to ``num_experts - 1``), read on
        the host: what :meth:`accepts` asks (a call checks them on the device instead: no host
        read, :mod:`.protocol`)."""
        if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        wrong = (topk_idx < -1) | (topk_idx >= self.num_experts)
        if bool(wrong.any()):
            t, k = (int(i) for i in wrong.nonzero()[0])
            return self.describe_refusal(protocol.REFUSED_EXPERT_ID, t * self.top_k + k, int(topk_idx[t, k]))
        return None

    def _dispatch_problem(self, x: Any, topk_idx: Any) -> str | None:
        """What is wrong with a dispatch's arguments on this member, or ``None``: the one statement
        of a valid dispatch (:meth:`accepts` asks it too)."""
        if not isinstance(x, torch.Tensor):
            return f"x must be a torch.Tensor, got {type(x).__name__}"
        if x.dim() != 2 or x.shape[1] != self.hidden:
            return f"x must be [tokens, hidden={self.hidden}], got {tuple(x.shape)}"
        tokens = x.shape[0]
        if tokens > self.max_tokens:
            return (
                f"x has {tokens} tokens, more than max_tokens={self.max_tokens}: split the batch, or make the "
                "dispatcher with a larger max_tokens"
            )
        return self.tensor_problem("x", x, dtype=self.dtype, shape=(tokens, self.hidden)) or self.tensor_problem(
            "topk_idx", topk_idx, dtype=torch.int64, shape=(tokens, self.top_k)
        )

    def _combine_problem(self, expert_out: Any, topk_weights: Any, handle: Any) -> str | None:
        """What is wrong with a combine's arguments on this member, or ``None``."""
        if not isinstance(handle, Handle) or not all(isinstance(t, torch.Tensor) for t in handle):
            return f"handle must be the Handle this dispatcher's dispatch returned, got {type(handle).__name__}"
        want, per = (self.local_experts, self.size * self.max_tokens), (self.local_experts, self.size)
        if handle.src.shape != want or handle.per_source.shape != per or handle.offsets.shape != per:
            return "handle comes from another dispatcher (its shapes differ)"
        if handle.per_source.data_ptr() not in self._live:  # its src was rewritten by the dispatch after next
            return "handle is from neither of this dispatcher's last two dispatches (its rows were reused)"
        tokens = handle.topk_idx.shape[0]
        return self.tensor_problem(
            "expert_out", expert_out, dtype=self.dtype, shape=(*want, self.hidden)
        ) or self.tensor_problem("topk_weights", topk_weights, dtype=torch.float32, shape=(tokens, self.top_k))

    def accepts(self, x: Any, topk_idx: Any) -> bool:
        """Whether ``dispatch(x, topk_idx)`` passes this rank's input checks: False exactly when
        the call would raise :class:`~symmsync.InputError`, by the rule the call checks with
        (types, shapes, dtypes, devices, the token count; and the ids, which this reads on the
        host: a device synchronization on GPUs, where the call checks them on the device). It
        says nothing of the other members' calls, nor of a dispatcher that failed before."""
        bad = self._dispatch_problem(x, topk_idx)
        return bad is None and (x.shape[0] == 0 or self._ids_problem(topk_idx) is None)

    # ------------------------------------------------------------------ calls
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, wait: bool = True) -> Any:
        """Send every token to the members that own its experts; receive this member's rows.

        Args:
            x: this member's tokens, ``[tokens, hidden]`` of the dispatcher's dtype, ``tokens`` at
                most ``max_tokens`` (0 too).
            topk_idx: ``[tokens, top_k]`` int64 expert ids; -1 masks an entry. An entry naming
                the expert of an earlier entry of its token is not sent again.
            wait: ``False``: launch the send only and return a :class:`Pending`, whose ``wait()``
                launches the receive and returns what this returns: work launched in between
                overlaps the transfer (eager and in CUDA graphs; not under ``torch.compile``).

        Returns:
            ``(recv, counts, handle)``. ``recv`` is ``[local experts, members * max_tokens, hidden]``
            of the dtype (with ``fp8``: a pair ``(codes, scales)``, ``codes`` that shape of
            ``torch.float8_e4m3fn``, ``scales`` ``[local experts, members * max_tokens, hidden / 128]``
            float32). Packed: ``recv[e][:counts[e]]`` holds every row local expert ``e`` received, in
            (source member, token index) order: member ``s``'s from ``handle.offsets[e][s]``, its
            ``j``-th token routed to ``e`` at ``handle.offsets[e][s] + j``. Rows past ``counts[e]``
            are an earlier call's, or zeros (a refused or differing call's: all NaN, ``counts`` 0). ``counts``
            is ``[local experts]`` int64, the rows each received (on the device); ``handle`` goes
            to :meth:`combine` (its ``per_source`` holds the count per member).

        Every member must call it, in the same order of dispatches and combines. Two launches
        (:mod:`symmsync.moe.protocol`), no host synchronization: the ids are checked on the
        device. The senders store the rows where ``recv`` is, once: ``recv`` (and its scales)
        and ``handle.src`` are views of this member's workspace, in one of two buffers taken in
        turn, valid until this member launches its dispatch after next (work launched on the
        dispatcher's stream before that dispatch reads them safely; a combine of this handle
        may come after the next dispatch). Clone what must live longer. ``counts``,
        ``handle.per_source`` and ``handle.offsets`` are new.

        Raises:
            InputError: a bad argument on this member (found on the host, or an expert id out of
                range found on the device: the message names the earliest such entry, in token
                then entry order): the step is made all the same, with nothing sent, so
                every member's call fails and the next call of every member goes on; the others
                raise :class:`~symmsync.PeerRefused` naming this member and why. (On GPUs an id
                found on the device raises at :meth:`synchronize`.)
            StepMismatch: a member made a combine instead (on every member; the dispatcher fails).
            SignalTimeout: a member did not dispatch within the budget (naming it);
                :class:`~symmsync.SignalAborted` (a :class:`~symmsync.PeerAborted`): one aborted.
            ClosedError: the buffer is closed.

        Under ``torch.compile``: ``symmsync::moe_dispatch``.
        """
        if torch.compiler.is_compiling():
            if wait is not True:
                raise ConfigError(f"rank {self.rank}: moe.Dispatcher.dispatch(wait=False) is eager only (and graphs)")
            outs = torch.ops.symmsync.moe_dispatch(
                x, topk_idx, self.op_handle, self.local_experts, self.size, self.max_tokens, self.fp8
            )
            return self._outputs(outs, topk_idx)
        if wait is False:
            inner = self.eager_dispatch(x, topk_idx, wait=False)
            return Pending(lambda: self._outputs(inner.wait(), topk_idx), "dispatch", self.rank)
        return self._outputs(self.eager_dispatch(x, topk_idx, wait), topk_idx)

    def _outputs(self, outs: tuple, topk_idx: torch.Tensor) -> tuple[Any, torch.Tensor, Handle]:
        recv, scales, counts, src, per_source, offsets = outs
        return ((recv, scales) if self.fp8 else recv), counts, Handle(topk_idx, src, per_source, offsets)

    def eager_dispatch(self, x: Any, topk_idx: Any, wait: bool = True) -> Any:
        """The checked dispatch: what :meth:`dispatch` and ``symmsync::moe_dispatch`` run. Returns
        ``(recv, scales, counts, src, per_source, offsets)`` (``scales`` empty without fp8), or
        with ``wait=False`` a :class:`Pending` whose ``wait()`` returns them."""
        self.check_usable()
        bad = self._dispatch_problem(x, topk_idx) or _wait_problem(wait)
        refused = self.start_call(bad)  # a refusal staged with its reason: the step goes on, sending nothing
        el, size = self.local_experts, self.size
        if bad is not None:  # the step is made all the same: nothing sent, the refusal in its header
            x, topk_idx = self._no_tokens
        tokens = x.shape[0]
        b = self._dispatches % 2  # the buffer the rows land in (its offset: a size word of the step's header)
        self._dispatches += 1
        recv, scales, src = self._buffers[b]
        shapes = (el, (el, size), (el, size))  # three allocations: an op's returns share no storage
        counts, per_source, offsets = (torch.empty(n, dtype=torch.int64, device=self._device) for n in shapes)
        self._live = [*self._live[-1:], per_source.data_ptr()]
        grid = (self.programs if bad else min(max(tokens, 1) * self._chunks, self.programs), 1, 1)  # bad: NaN rows
        self._launch("dispatch_send", grid, b, kernel_view(x), topk_idx, tokens, refused)

        def receive() -> tuple[torch.Tensor, ...]:
            self._pending = None
            self._launch("dispatch_recv", (1, 1, 1), b, counts, per_source, offsets)
            self.finish_call(bad, "dispatch")  # the host backend: what the step found; then this member's refusal
            return recv, scales, counts, src, per_source, offsets

        return receive() if wait is not False else self._pend(receive, "dispatch")

    def _pend(self, receive: Any, what: str) -> Pending:
        self._pending = Pending(receive, what, self.rank)
        return self._pending

    def combine(
        self, expert_out: torch.Tensor, topk_weights: torch.Tensor, handle: Handle, *, wait: bool = True
    ) -> Any:
        """Bring every expert's outputs back to the tokens' members and sum them per token.

        Args:
            expert_out: ``[local experts, members * max_tokens, hidden]`` of the dispatcher's dtype:
                row ``r`` of local expert ``e`` is the output for row ``r`` of the dispatch's ``recv``
                (rows past the counts are not read).
            topk_weights: ``[tokens, top_k]`` float32, this member's tokens' weights.
            handle: what the dispatch returned.
            wait: ``False``: launch the send only and return a :class:`Pending` (as
                :meth:`dispatch`), whose ``wait()`` launches the sum and returns ``y``.

        Returns:
            ``y``, ``[tokens, hidden]`` of the dtype: ``y[t] = dtype(acc)`` with ``acc = 0`` then, for
            ``k = 0 .. top_k - 1`` with ``topk_idx[t, k]`` an expert id,
            ``acc = acc + topk_weights[t, k] * float32(out_k)`` in float32 (``out_k`` the row expert
            ``topk_idx[t, k]`` returned for token ``t``: an entry repeating an expert adds that row
            again, with its own weight); the same bits on every run.

        Raises: as :meth:`dispatch` (a bad argument is found on the host). Under ``torch.compile``:
        ``symmsync::moe_combine``.
        """
        if torch.compiler.is_compiling():
            if wait is not True:
                raise ConfigError(f"rank {self.rank}: moe.Dispatcher.combine(wait=False) is eager only (and graphs)")
            return torch.ops.symmsync.moe_combine(expert_out, topk_weights, *handle, self.op_handle)
        if not isinstance(handle, Handle):
            return self.eager_combine(expert_out, topk_weights, handle, None, None, None, wait=wait)
        return self.eager_combine(expert_out, topk_weights, *handle, wait=wait)

    def accepts_combine(self, expert_out: Any, topk_weights: Any, handle: Any) -> bool:
        """Whether ``combine(expert_out, topk_weights, handle)`` passes this rank's input checks,
        by the rule the call checks with (as :meth:`accepts`)."""
        return self._combine_problem(expert_out, topk_weights, handle) is None

    def eager_combine(
        self,
        expert_out: Any,
        topk_weights: Any,
        topk_idx: Any,
        src: Any,
        per_source: Any,
        offsets: Any,
        wait: bool = True,
    ) -> Any:
        """The checked combine (a handle's parts): what :meth:`combine` and ``symmsync::moe_combine`` run
        (with ``wait=False`` a :class:`Pending` whose ``wait()`` returns ``y``)."""
        self.check_usable()
        handle = topk_idx if src is None else Handle(topk_idx, src, per_source, offsets)
        bad = self._combine_problem(expert_out, topk_weights, handle) or _wait_problem(wait)
        refused = self.start_call(bad)
        if bad is not None:  # the step is made all the same: nothing sent, the refusal in its header
            expert_out, topk_weights, handle = self._no_outputs
        el, size = self.local_experts, self.size
        tokens = handle.topk_idx.shape[0]
        y = torch.empty((tokens, self.hidden), dtype=self.dtype, device=self._device)
        send = (el * size, self._blocks, 1)
        self._launch("combine_send", send, -1, kernel_view(expert_out), handle.per_source, handle.offsets, handle.src,
                     refused)  # fmt: skip

        def receive() -> torch.Tensor:
            self._pending = None
            grid = (min(max(tokens, 1) * self._chunks, self.combine_programs), 1, 1)
            self._launch("combine_reduce", grid, -1, kernel_view(y), handle.topk_idx, topk_weights, tokens,
                         handle.per_source)  # fmt: skip
            self.finish_call(bad, "combine")
            return y

        return receive() if wait is not False else self._pend(receive, "combine")

    # ------------------------------------------------------------------ failures
    def synchronize(self) -> None:
        """Wait for the device, then raise what the steps since the last one found: a failed wait
        (:class:`~symmsync.SignalTimeout`, :class:`~symmsync.SignalAborted`: the dispatcher fails),
        then the earliest failed step (:class:`StepMismatch`: the dispatcher fails; a device-found
        expert id's :class:`~symmsync.InputError`, or :class:`~symmsync.PeerRefused`: the call
        only), once, however many steps came after it. On the host backend calls raise by
        themselves. A runtime that does not synchronize reads :attr:`~symmsync.Consumer.status`."""
        super().synchronize()

    def release(self, together: bool) -> None:
        try:
            super().release(together)
        finally:
            self.sigs.close()  # its signal memory

    def __repr__(self) -> str:
        return (
            f"Dispatcher(view={list(self.view.ranks)}, num_experts={self.num_experts}, max_tokens={self.max_tokens}, "
            f"hidden={self.hidden}, dtype={self.dtype}, top_k={self.top_k}, fp8={self.fp8})"
        )
