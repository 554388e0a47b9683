"""AllReduce, AllGather and ReduceScatter over a peer view: the host side.

Each object is made collectively and owns a workspace in the view's buffer
(:mod:`.layout`) and a :class:`~symmsync.Fence` channel of the view; a call is one
kernel launch (:mod:`.kernels`), packed once per variant (:mod:`symmsync.core.launch`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends.mode import kernels_interpreted
from ..checks import int_problem, require
from ..core.consumer import Consumer
from ..core.launch import BoundLaunch, Launcher, kernel_view
from ..core.views import PeerView
from ..errors import ClosedError, ConfigError, InputError
from ..language import calls as ssl_calls
from ..language import records
from . import kernels, making, tuning
from . import layout as L
from .inputs import call_problem, fused_problem
from .mismatch import CollectiveMismatch, StallRecord, describe_kit

# Elements per block of a program (a power of two); warps per program.
_BLOCK = 1024
_NUM_WARPS = 4
# What a call passes its bound launch (BoundLaunch: the rest is bound once), by the kernel's
# parameter names, so no position is written here and the kernel's signature can change.
_PER_CALL = ("x", "out", "count", "refused")
_FUSED_CALL = ("x", "out", "count", "residual", "weight", "res_out", "hidden", "eps", "refused")
KERNEL = kernels.collective_kernel
"""The kernel every operation launches, read when an operation first launches a variant (a seam:
a test may set it, before it constructs an operation, to a variant of the kernel built in the
tests from the same halves; ``kernels.collective_kernel`` is the only kernel shipped)."""
FORMS: dict[int, Any] = {}
"""Each operation's form over a view that spans nodes, by operation code: what its constructor
makes there and its checked call runs (registered by :mod:`.spanning`, which builds its node
steps from the classes of this module, so this module names it not)."""
_INTERPRETED = kernels_interpreted()  # bfloat16 travels as its int16 bits (numpy has none)
_NO_GRAD = "the collectives have"  # no autograd formula (symmsync.checks.tensor_problem words it)


class _Collective(Consumer):
    """What the three operations share: construction, the workspace, launches, failures."""

    _OP = 0
    KINDS = ("-", "call", "call", "call")  # by operation code (the kind a call's header carries)
    MISMATCH = CollectiveMismatch
    REFUSED_OUTCOME = "no member's call did anything (its outputs hold NaN), and the next call goes on"

    def __init__(
        self,
        view: PeerView,
        max_numel: int,
        dtype: torch.dtype,
        *,
        algorithm: str | None = None,
        offset: int = 0,
        channel: int = 0,
        timeout_s: float | None = None,
    ):
        self._over = None
        self._channel = channel
        if isinstance(view, PeerView) and not view.nodes.single:  # a layout every member sees alike
            self._init_over_nodes(view, max_numel, dtype, algorithm, offset, channel, timeout_s)
            return
        make = making.start(self.NAME, view, max_numel, dtype, algorithm, offset)
        buf, ws = make.buffer, None
        if make.ok:
            ws = L.Workspace.plan(offset, max_numel, dtype, view.size, reduced=self._OP == L.ALL_REDUCE)
            making.fits(make, offset, ws.nbytes)
        fence = make.fence(channel, timeout_s)  # a bad channel or timeout is agreed like the rest
        making.claim_workspace(make, channel, ws)  # shared only by collectives of this layout on this channel
        making.agree(make, making.arguments(max_numel, dtype, algorithm, offset, channel))
        self._keep(view, max_numel, dtype)
        self.made(make, where=f"{self.NAME} (channel {channel})", memory=self._memory_words(buf), no_grad=_NO_GRAD)
        making.set_protocol_words(buf, ws)
        self.fence = fence
        """The :class:`~symmsync.Fence` whose channel the collective synchronizes on (``None`` over a view
        that spans nodes: its node steps have theirs)."""
        self.workspace = ws
        """Where the collective's bytes live in every member (:class:`~symmsync.collectives.layout.Workspace`;
        ``None`` over a view that spans nodes: :func:`~symmsync.collectives.layout.node_steps`)."""
        self.node_view = self.steps = self.offnode = None
        """Over a view that spans nodes: the view's node view, the node steps over it (collectives,
        in call order) and the view's exchange (:mod:`symmsync.spanning.parts`); ``None`` here."""
        caps = buf.capabilities
        self._traps = caps.traps
        self._max_programs = self.device_programs(1, 1)  # every program resident at once (the interpreter: one)
        self._record = torch.zeros(records.COLLECTIVE_RECORD_WORDS, dtype=torch.int64, pin_memory=caps.pinned_record)
        self.waits = (fence, StallRecord(self._record, self.NAME, view.ranks, fence))
        self._sym_bytes = buf.tensor(ws.symmetric, (ws.capacity,), torch.uint8)
        self._sym_addr = self._sym_bytes.data_ptr()
        self._limits = {d: ws.capacity // d.itemsize for d in L.DTYPES}
        self._launchers: dict[tuple, Launcher] = {}
        # variant -> its bound launch (a call repacks only the arguments that changed)
        self._bound: dict[tuple, BoundLaunch] = {}
        # The fused epilogue's arguments of a launch without it: unused, of the launch's dtype.
        self._plain_tail = {}
        for d in L.DTYPES:
            dummy = kernel_view(torch.zeros(1, dtype=d, device=buf.device))
            self._plain_tail[d] = dict(residual=dummy, weight=dummy, res_out=dummy, hidden=0, eps=0.0)
        self._fixed = dict(
            ptrs=view.ptrs,
            **dict(zip(("sptrs", "cell", "me", "timeout_ns", "record"), fence.kernel_args)),
            calls=self.calls.kernel_args[0],
            mism=self._record.data_ptr(),
            counter_off=ws.counter,
            inputs=ws.inputs,
            input_stride=ws.input_stride,
            symmetric=ws.symmetric,
            reduced=ws.reduced,
        )

    def _init_over_nodes(self, view, max_numel, dtype, algorithm, offset, channel, timeout_s) -> None:
        """Over a view that spans nodes: the operation's form there (:data:`FORMS`), its node steps
        and the view's exchange; the same calls, checks and failures (:mod:`.spanning`)."""
        form = FORMS[self._OP](self, view, max_numel, dtype, algorithm, offset, channel, timeout_s)
        self._keep(view, max_numel, dtype)
        self._over = form
        self.fence = self.workspace = None
        self.node_view, self.steps, self.offnode = form.node_view, form.steps, form.exchange
        self._sym_bytes = form.input_memory()
        self._sym_addr = self._sym_bytes.data_ptr()
        self._limits = form.limits
        self._bound = {}
        self._channel = -1
        where = f"{self.NAME} (over {view.nodes.num_nodes} nodes)"
        self.made(form.make, where=where, memory=self._memory_words(view.buffer), no_grad=_NO_GRAD, calls=False)

    @staticmethod
    def _memory_words(buf: Any) -> str:
        return f"the collective's memory on {buf.device}"

    def _keep(self, view: PeerView, max_numel: int, dtype: torch.dtype) -> None:
        """What every form keeps of its arguments, once they are agreed (:func:`.making.agree`)."""
        self.view = view
        self.size = view.size
        self.max_numel = max_numel
        self.dtype = dtype

    # ------------------------------------------------------------------ public
    def input(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This member's symmetric input: a tensor of ``numel`` elements to fill in place.

        Passing it to a call skips the copy-in (the members read it where it lies). It is
        the same memory on every call; the call returns (in stream order) only after
        every member finished reading it, so it can be refilled at once. (Over a view that
        spans nodes: the all-reduce's node reduce-scatter's input; the others' plain memory.)

        Raises:
            ConfigError: ``numel`` or ``dtype`` is not one the collective takes.
            ClosedError: the buffer or the collective is closed.
        """
        dtype = self.dtype if dtype is None else dtype
        call = f"{self.NAME}.input"
        if self.buffer.closed or self._closed:
            what = "close()" if self._closed else "its buffer was closed"
            raise ClosedError(f"rank {self.rank}: {call}: used after {what}")
        if dtype not in self._limits:
            require(f"dtype must be one of {', '.join(map(str, L.DTYPES))}, got {dtype!r}", rank=self.rank, call=call)
        require(int_problem("numel", numel, minimum=0, maximum=self._limits[dtype]), rank=self.rank, call=call)
        return self._sym_bytes[: numel * dtype.itemsize].view(dtype)

    def accepts(self, x: Any, out: Any = None) -> bool:
        """Whether a call with these arguments passes this rank's input checks: False exactly when
        the call would raise :class:`~symmsync.InputError` (failing that call on every member), by
        the same rule the call checks with. Ask it to fall back to another path for an input that
        does not fit (dtype, size, device, contiguity, grad). It says nothing of the other members'
        calls, nor of a collective that failed or was closed before."""
        return call_problem(self, x, out) is None

    def synchronize(self) -> None:
        """Wait for the device, then raise what the calls since the last one found.

        On GPUs a call returns before it ran: a call another member refused, or whose members'
        calls differ, stores NaN into its outputs and raises here, :class:`~symmsync.PeerRefused`
        (once; the collective goes on) or :class:`CollectiveMismatch` (the collective fails); a
        wait that timed out or saw an abort traps and raises its :class:`~symmsync.FenceTimeout`
        (:class:`~symmsync.PeerAborted`). A runtime that does not synchronize reads the
        collective's :attr:`~symmsync.Consumer.status` word instead. On the host backend calls
        raise by themselves.

        Members that share one GPU (two processes on one device): a trap in one member's
        CUDA context has left another's ``torch.cuda.synchronize()`` blocked for good. There
        this raises the recorded error as soon as the record holds it, without waiting for
        the device, and a :class:`~symmsync.FenceTimeout` saying so when neither the device
        nor a record answers within twice the fence's budget (plus 30 s); every error of
        such a member names the members it shares its GPU with.
        """
        if self._over is not None:
            self._over.synchronize()
            return
        super().synchronize()

    def release(self, together: bool) -> None:
        if self._over is None:
            super().release(together)
            return
        try:  # its node steps hold the bytes, and close alike on every rank
            for step in self._over.steps:
                step.close(together)
        finally:
            self.release_tables()

    def describe_call(self, header: list[int], number: int) -> dict[str, Any]:
        return describe_kit(header, number)

    # ------------------------------------------------------------------ a call
    def _traced(self, op: Any, args: tuple, out: Any, *after: Any, half: bool = False) -> Any:
        """A call ``torch.compile`` traces: ``op(*args, self.op_handle, *after)`` (:mod:`.torch_ops`), which
        makes the eager call's checked path when the graph runs; no data pointer is read. Raises
        ConfigError while tracing for an ``out=`` (the op returns new tensors) or a ``half`` epilogue."""
        if out is not None or half:
            what = "pass residual= and norm_weight=" if half else "out= is eager-only (the op returns new tensors)"
            raise ConfigError(f"rank {self.rank}: {self.NAME} under torch.compile: {what} (docs/collectives.md)")
        return op(*args, self.op_handle, *after)

    def _launch(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        numel: int,
        algorithm: int,
        count: int = -1,
        epilogue: dict | None = None,
        refused: int = 0,
    ) -> None:
        # The hot path of an eager call and of the op's body: a few comparisons, one launch
        # (which repacks nothing when the tensors are those of the last call of this variant).
        # A closed buffer's views are never clean (close() aborts them first).
        if self._closed or not self._failure.clean:
            self.check_usable()
        if self._over is not None:  # over nodes: the form's steps
            return self._over.launch(x, out, numel, algorithm, count, epilogue)
        count = numel if count < 0 else count  # the kernel's element count (the reduce-scatter's chunk)
        if epilogue is None:
            row = 0
            grid = min(self._max_programs, max(1, -(-numel // _BLOCK)))  # (triton.cdiv costs microseconds)
        else:  # whole rows per program
            row = 1 << (epilogue["hidden"] - 1).bit_length()
            grid = min(self._max_programs, max(1, numel // epilogue["hidden"]))
        key = (x.dtype, algorithm, x.data_ptr() == self._sym_addr, grid, row)
        if _INTERPRETED:  # numpy has no bfloat16: its bits travel (no call on a GPU's hot path)
            x, out = kernel_view(x), kernel_view(out)
        bound = self._bound.get(key)
        if bound is None:
            tail = self._plain_tail[key[0]] if epilogue is None else {}
            per_call = _PER_CALL if epilogue is None else _FUSED_CALL
            bound = self._launcher(key).bind_named(grid=(grid,), per_call=per_call, **self._fixed, **tail)
            self._bound[key] = bound
        try:
            if epilogue is None:
                bound(x, out, count, refused)
            else:
                e = epilogue
                bound(x, out, count, kernel_view(e["residual"]), kernel_view(e["weight"]), kernel_view(e["res_out"]),
                      e["hidden"], e["eps"], refused)  # fmt: skip
        except Exception as err:
            # A launch that raised (an error of symmsync's from inside an interpreted kernel, a
            # failed compile or launch) may have run part of the call: the collective fails with
            # it and the members are told, so no later call of this rank's can meet theirs.
            self.fail(err)
            raise
        if self._host_checks:  # the launch has run: raise what it found (a refusal of its own is not kept)
            self.settle()

    def _launcher(self, key: tuple) -> Launcher:
        dtype, algorithm, sym, _grid, row = key
        lk = (dtype, algorithm, sym, row)
        launcher = self._launchers.get(lk)
        if launcher is None:
            launcher = self._launchers[lk] = Launcher(
                KERNEL,
                (1,),
                num_warps=_NUM_WARPS if row <= 4096 else 2 * _NUM_WARPS,
                SIZE=self.size,
                OP=self._OP,
                TWO_SHOT=algorithm == L.ALGORITHM_CODES["two_shot"],
                SYMMETRIC=sym,
                BLOCK=_BLOCK,
                TRAP=self._traps,
                BF16_BITS=_INTERPRETED and dtype is torch.bfloat16,
                DTYPE_CODE=L.DTYPES[dtype],
                ALGORITHM=algorithm,
                EPILOGUE=row > 0,
                ROW=max(row, 1),
            )
        return launcher

    def out_numel(self, numel: int) -> int:
        """The elements of a call's output for ``numel`` input elements (the all-reduce's: as many)."""
        return numel

    def _output(self, x: Any, out: Any) -> torch.Tensor:
        """``out`` (a new 1-D tensor when ``None``), after refusing the call if its tensors are wrong."""
        bad = call_problem(self, x, out)
        if bad is not None:
            self.refuse(bad)
        return torch.empty(self.out_numel(x.numel()), dtype=x.dtype, device=x.device) if out is None else out

    # ------------------------------------------------------------------ failures
    def check_usable(self) -> None:
        """Raise if this collective may not run a call (:meth:`symmsync.Consumer.check_usable`:
        its buffer or itself closed, its own failure first, the first failed call's error raised
        again by every later call), then if its fence failed a wait of its own (used directly)."""
        super().check_usable()
        if self.fence is not None:
            self.fence.check_usable()  # then a failed wait of the fence's own (used directly)

    def refuse(self, problem: str, call: str = "", error: type = InputError) -> None:
        """Refuse a bad call on this member: the call fails on every member, and nothing else.

        This member still makes the call, with nothing to send and its header refused with
        ``problem`` (:meth:`launch_refused`), so that every member publishes once and reads
        nothing, and the members' epochs stay in step; every member's outputs of the call hold
        NaN. It raises ``error`` here, and the others raise :class:`~symmsync.PeerRefused` naming
        this member and ``problem`` (on GPUs at their :meth:`synchronize`). The collective stays
        usable. Over a view that spans nodes it runs every step of the call refused
        (:meth:`symmsync.collectives.spanning._NodeSteps.refuse`), with the same outcome."""
        if self._over is None:
            return super().refuse(problem, call, error)
        self.check_usable()
        self._over.refuse(problem)
        raise self.refusal(problem, call, error)

    def launch_refused(self, call: str = "", refused: int = 0) -> None:
        """Take part in the next call with nothing to send, its header refused (the kit's
        :meth:`~symmsync.Consumer.refuse`), raising nothing of it here: :meth:`refuse`'s launch, and
        a refused node step's over nodes (which stages no reason: its header says ``refused`` only)."""
        if not refused:  # a node step of a call refused across nodes: the reason travels in the store
            self.calls.stage("its call across nodes was refused")
            refused = ssl_calls.REFUSED_HOST
        dummy = torch.empty(0, dtype=self.dtype, device=self.buffer.device)  # nothing is read or written
        algorithm = 0 if self._OP == L.ALL_REDUCE else -1
        self._launch(dummy, dummy, 0, algorithm, 0, refused=refused)

    def release_tables(self) -> None:
        """Drop the buffer's tables and memory this collective holds (the buffer's ``close()``
        calls it, through the view's failure owner): its bound launches, their fixed arguments
        and its symmetric input, so that only what users kept holds the mappings. Its calls
        raise :class:`~symmsync.ClosedError` from then on, before any launch."""
        super().release_tables()
        self._bound = {}
        self._fixed = {}
        self._sym_bytes = None


class AllReduce(_Collective):
    """The elementwise sum over a peer view's members, the same bits on every member.

    Args:
        view: the members (a :class:`~symmsync.PeerView`).
        max_numel: the largest call, in elements of ``dtype``.
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``: the element
            type the workspace is sized for (a call may use another of the three, up to
            the same bytes).
        algorithm: ``"one_shot"``, ``"two_shot"`` or ``"auto"`` (by size and view size:
            :mod:`symmsync.collectives.tuning`).
        offset: where the workspace starts in the view's buffer (a multiple of 128;
            :func:`workspace_bytes` says how much it takes).
        channel: the view's fence channel to synchronize on (one per collective object).
        timeout_s: wait budget (default: the backend's).

    Made collectively: every rank of the buffer's group constructs its object at the
    same time, the members of a view with the same arguments, or every rank raises
    :class:`~symmsync.ConfigError` (:class:`~symmsync.BoundsError` when the workspace
    does not fit).

    Over a view whose members span nodes, the three operations make their form over nodes
    (:mod:`symmsync.collectives.spanning`): the same calls, in node steps and an exchange
    between nodes, with the order of additions of docs/collectives.md, "Across nodes".
    """

    _OP = L.ALL_REDUCE
    NAME = "AllReduce"

    def __init__(
        self,
        view: PeerView,
        max_numel: int,
        dtype: torch.dtype,
        algorithm: str = "auto",
        *,
        offset: int = 0,
        channel: int = 0,
        timeout_s: float | None = None,
    ):
        super().__init__(
            view, max_numel, dtype, algorithm=algorithm, offset=offset, channel=channel, timeout_s=timeout_s
        )
        self.algorithm = algorithm
        self._codes = {**L.ALGORITHM_CODES, "auto": -1}

    def __call__(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        algorithm: str | None = None,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
        residual_out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The sum of every member's ``x``, elementwise, accumulated in float32 in member order.

        Args:
            x: this member's input (contiguous, on the buffer's device), or the tensor
                :meth:`input` returned, filled in place (no copy-in).
            out: where to write the sum (``x``'s dtype and number of elements; may be ``x``).
            algorithm: this call's algorithm (default: the object's).
            residual: with ``norm_weight``, the fused epilogue of a decode layer, in the
                same kernel: ``new_residual = sum + residual`` and
                ``out = rms_norm(new_residual) * norm_weight`` over the last dimension
                (``x.shape[-1]``, at most :data:`MAX_HIDDEN`); ``residual`` has ``x``'s
                shape and dtype, ``norm_weight`` is ``[x.shape[-1]]`` of ``x``'s dtype.
                Runs one-shot (``algorithm`` ``"auto"`` or ``"one_shot"``).
            norm_weight: the RMS norm's weight (with ``residual``).
            eps: the RMS norm's epsilon.
            residual_out: where to write the new residual (may be ``residual``; default: a
                new tensor).

        Every member must make the same call (size, dtype, algorithm, input kind,
        epilogue), in the same order. Returns ``out`` (a new tensor of ``x``'s shape when
        not given); with the epilogue ``(out, residual_out)``. The epilogue's arithmetic::

            s = dtype(member-order float32 sum)                # what the plain call returns
            residual_out = dtype(float32(s) + float32(residual))
            h = float32(residual_out)
            out = dtype(h / sqrt(mean(h * h) + eps) * float32(norm_weight))

        Raises:
            InputError: a bad argument on this member (an input that requires grad while grad
                mode is on among them: no autograd formula): the call is made refused, with
                nothing sent, and fails on every member (its members raise
                :class:`~symmsync.PeerRefused` naming it; on GPUs at their ``synchronize()``);
                the next call goes on. :class:`CollectiveMismatch` on every member when their
                calls differ.
            PeerRefused: another member refused this call (its input failed its checks).
            FenceTimeout: a member did not arrive within the budget
                (:class:`~symmsync.PeerAborted`: it aborted).
            ClosedError: the buffer is closed (nothing is launched).

        Any other failed call fails the collective for good: every later call raises the same
        error again without launching (docs/collectives.md, "When a call fails"). Under
        ``torch.compile``: ``symmsync::all_reduce`` (``all_reduce_residual_rms_norm``), no ``out=``.
        """
        if torch.compiler.is_compiling():
            alg = algorithm or self.algorithm
            if residual is None and norm_weight is None:
                return self._traced(torch.ops.symmsync.all_reduce, (x,), out, alg)
            args, outs = (x, residual, norm_weight, eps), out if residual_out is None else residual_out
            half = residual is None or norm_weight is None
            return self._traced(torch.ops.symmsync.all_reduce_residual_rms_norm, args, outs, alg, half=half)
        if residual is not None or norm_weight is not None:
            return self.eager_fused(x, out, algorithm, residual, norm_weight, eps, residual_out)
        return self.eager(x, out, algorithm)

    def accepts(
        self,
        x: Any,
        out: Any = None,
        *,
        algorithm: str | None = None,
        residual: Any = None,
        norm_weight: Any = None,
        eps: Any = 1e-6,
        residual_out: Any = None,
    ) -> bool:
        """Whether ``self(x, out, ...)`` with these arguments passes this rank's input checks:
        False exactly when the call would raise :class:`~symmsync.InputError`, by the rule the
        call checks with (:meth:`~symmsync.collectives.AllGather.accepts` says what it covers)."""
        if residual is not None or norm_weight is not None:
            return fused_problem(self, x, out, algorithm, residual, norm_weight, eps, residual_out) is None
        return call_problem(self, x, out) is None and (algorithm or self.algorithm) in self._codes

    def eager(self, x: Any, out: Any = None, algorithm: str | None = None) -> torch.Tensor:
        """The checked call without the epilogue, launched now: what ``__call__`` runs outside compiled code
        and ``symmsync::all_reduce`` runs when a compiled graph calls it."""
        code = self._codes.get(algorithm or self.algorithm)
        bad = call_problem(self, x, out)
        if bad is not None or code is None:
            self.refuse(bad or f"algorithm must be one of {L.ALGORITHMS}, got {algorithm!r}")
        numel = x.numel()
        if code < 0:  # auto: the rule is tuning.choose's
            code = L.ALGORITHM_CODES[tuning.choose(numel * x.element_size(), self.size)]
        if out is None:
            out = torch.empty_like(x)
        self._launch(x, out, numel, code)
        return out

    def eager_fused(self, x, out, algorithm, residual, weight, eps, res_out) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked call with the fused residual + RMS norm epilogue (one-shot, whole rows per
        program): what ``__call__`` and ``symmsync::all_reduce_residual_rms_norm`` run."""
        bad = fused_problem(self, x, out, algorithm, residual, weight, eps, res_out)
        if bad is not None:
            self.refuse(bad)
        out = torch.empty_like(x) if out is None else out
        res_out = torch.empty_like(x) if res_out is None else res_out
        epilogue = dict(residual=residual, weight=weight, res_out=res_out, hidden=x.shape[-1], eps=float(eps))
        self._launch(x, out, x.numel(), 0, epilogue=epilogue)
        return out, res_out


class AllGather(_Collective):
    """Every member's input, concatenated in view order, on every member.

    Args: as :class:`AllReduce` (no algorithm). A call ``ag(x)`` returns a 1-D tensor of
    ``view.size * x.numel()`` elements; ``x`` may be the tensor :meth:`input` returned.
    """

    _OP = L.ALL_GATHER
    NAME = "AllGather"

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather every member's ``x`` (same numel and dtype on every member) into ``out``.

        Raises: as :meth:`AllReduce.__call__`. Under ``torch.compile``: ``symmsync::all_gather``.
        """
        if torch.compiler.is_compiling():
            return self._traced(torch.ops.symmsync.all_gather, (x,), out, self.size)
        return self.eager(x, out)

    def eager(self, x: Any, out: Any = None) -> torch.Tensor:
        """The checked call, launched now: what ``__call__`` and ``symmsync::all_gather`` run."""
        out = self._output(x, out)
        self._launch(x, out, x.numel(), -1)
        return out

    def out_numel(self, numel: int) -> int:
        return self.size * numel


class ReduceScatter(_Collective):
    """Member ``i`` gets the sum over the members of chunk ``i`` of their inputs.

    Args: as :class:`AllReduce` (no algorithm). A call ``rs(x)``, ``x.numel()`` a
    multiple of ``view.size``, returns a 1-D tensor of ``x.numel() // view.size``
    elements: chunk ``i`` of every member's ``x``, summed in float32 in member order.
    """

    _OP = L.REDUCE_SCATTER
    NAME = "ReduceScatter"

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce-scatter every member's ``x`` into ``out`` (this member's chunk of the sum).

        Raises: as :meth:`AllReduce.__call__`. Under ``torch.compile``: ``symmsync::reduce_scatter``.
        """
        if torch.compiler.is_compiling():
            return self._traced(torch.ops.symmsync.reduce_scatter, (x,), out, self.size)
        return self.eager(x, out)

    def eager(self, x: Any, out: Any = None) -> torch.Tensor:
        """The checked call, launched now: what ``__call__`` and ``symmsync::reduce_scatter`` run."""
        out = self._output(x, out)
        self._launch(x, out, x.numel(), -1, self.out_numel(x.numel()))
        return out

    def out_numel(self, numel: int) -> int:
        return numel // self.size
