"""Fence: device-resident epochs and fused publish-and-wait among a peer view's ranks.

One :class:`Fence` is one channel of one peer view. Its state lives in the view's
cell for that channel, in device memory: this rank's epoch counter and the
slots where the other members publish theirs. So the host never holds an epoch,
and a captured CUDA graph advances the epoch on every replay.

* :meth:`Fence.fence` is one kernel launch: advance the epoch, publish it to every
  other member (release, system scope), wait until every member published it to
  this rank (acquire, system scope).
* :meth:`Fence.arrive` and :meth:`Fence.wait` split it into two launches, so work
  can run between them.

Every wait is bounded by ``timeout_s``. A wait that times out or sees an abort fails
closed: nothing after it may read peer data. On the host backend the host reads the
kernel's record and raises :class:`~symmsync.FenceTimeout`. On a GPU the kernel writes
the same record to pinned host memory and traps, so nothing after it on the stream
runs; :meth:`Fence.synchronize` (and :attr:`Fence.epoch`) turn
the resulting CUDA error into the same :class:`~symmsync.FenceTimeout`. Which of the
two happens, and the default budget, are the buffer's
:attr:`~symmsync.SymmetricBuffer.capabilities`, never its backend's name.

Failures reach every member at once: a rank that gives up (:meth:`Fence.abort`,
:meth:`~symmsync.PeerView.abort`, a fence after its own fence error, ``close()``)
sets an abort flag in its slot at every member (:func:`symmsync.language.mark_abort`),
and a member waiting for an epoch that rank never published returns within a poll
with :class:`~symmsync.PeerAborted`, naming the rank and its reason.

:func:`launch_grid_sync` launches a kernel that calls :func:`symmsync.language.grid_sync`
(a fence in which every program of the launch waits) after checking that its programs can
all be resident at once.

Under torch.compile each operation is the custom op ``symmsync::fence``
(:mod:`symmsync.ops.fence_op`), an side-effectful op in the graph: ``fullgraph=True`` compiles,
and the fence stays ordered with symmsync's own ops (the direct-KV writer's). Plain torch
writes into symmetric memory in the same graph are not ordered by it (functionalization
applies them at the end of the graph): see :mod:`symmsync.ops.fence_op`.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import backends
from .. import language as ssl
from ..backends import driver as cuda
from ..backends.mode import kernels_interpreted
from ..checks import require, timeout_problem
from ..errors import CLOSED_REASON, ClosedError, ConfigError, FenceTimeout, PeerAborted, SymmSyncError
from ..language import cells, records
from ..ops import fence_op as fence_ops
from ..ops import handles
from . import memory, nodes
from .failure import used_after_abort
from .launch import Launcher, cu_stream, current_stream
from .views import PeerView


@triton.jit
def _fence_kernel(
    ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr, ARRIVE: tl.constexpr, WAIT: tl.constexpr, TRAP: tl.constexpr
):
    if ARRIVE:
        e = ssl.publish(ptrs, cell, me, SIZE)
    else:
        e = tl.load(ssl.epoch_ptr(ptrs, cell, me))
    if WAIT:
        ssl.wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)


@triton.jit
def _refuse_kernel(ptrs, cell, me, timeout_ns, record, refused, SIZE: tl.constexpr, TRAP: tl.constexpr):
    # A fence whose publish carries a refusal: mark this rank's part of the epoch it is about to
    # publish as refused in every member's cell (its own too), then publish and wait as
    # _fence_kernel does. The marks are plain stores before the publish (its release covers
    # them, after the block barrier): a member whose wait for the epoch passed reads them.
    e = tl.load(ssl.epoch_ptr(ptrs, cell, me)) + 1
    for p in tl.static_range(SIZE):
        mark = ssl.peer_ptr(ptrs, p, cell + refused, tl.int64) + 2 * me + e % 2
        tl.store(mark, e)
    tl.debug_barrier()
    e = ssl.publish(ptrs, cell, me, SIZE)
    ssl.wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)


class Fence:
    """Channel ``channel`` of a peer view, as a fence.

    Args:
        view: the :class:`~symmsync.PeerView` whose members synchronize.
        channel: which of the view's channels (fences on different channels, or on
            different views, never touch each other's slots).
        timeout_s: wait budget in seconds, in ``(0, checks.MAX_TIMEOUT_S]`` (default: the
            ``default_timeout_s`` of the buffer's
            :attr:`~symmsync.SymmetricBuffer.capabilities`: 120 s on the host backend,
            which allows for the Triton interpreter on a loaded machine, 60 s on GPUs,
            which allows for a peer still compiling its first kernel).

    Every member of the view must create its fence for the same channel and call
    the same sequence of ``fence`` / ``arrive`` / ``wait``.

    Raises:
        ConfigError: a bad channel or budget.
        CaptureError: this rank's current stream is capturing a CUDA graph (creating a
            fence allocates and compiles: create it before capture). Raised on this rank,
            before any device work; creating a fence is not collective, so a member that
            did not capture is not told (ranks that capture the same code all raise).
        ClosedError: the buffer is closed.
    """

    def __init__(self, view: PeerView, channel: int = 0, *, timeout_s: float | None = None):
        backends.refuse_compiling("Fence")
        if backends.capturing(view.buffer.device):
            raise backends.capture_error(
                f"rank {view.rank}: Fence",
                "creating a fence allocates its record and compiles its kernels, which a capture cannot record",
                "Create fences before capture: their fence(), arrive() and wait() can be captured",
            )
        spans = nodes.spanning_problem(view.nodes, "a Fence")
        if spans:  # every member raises it: the view's layout is agreed
            raise ConfigError(f"rank {view.rank}: Fence: {spans}")
        self.cell = view.cell_offset(channel)  # checks the channel first
        """Byte offset of this fence's cell in every member's memory (kernel argument)."""
        buf = view.buffer
        caps = buf.capabilities
        self.view = view
        self.channel = channel
        self.backend = buf.backend
        """The buffer's backend name (shown in the repr)."""
        if timeout_s is None:
            timeout_s = caps.default_timeout_s
        require(timeout_problem(timeout_s), rank=buf.rank, call="Fence")
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(self.timeout_s * 1e9)
        """Wait budget in ns (kernel argument)."""
        self._record = torch.zeros(
            records.fence_record_words(view.size), dtype=torch.int64, pin_memory=caps.pinned_record
        )
        self.record = self._record.data_ptr()
        """Address of the timeout record (kernel argument; pinned host memory on GPUs)."""
        # The cell table holds the record too: every launch through kernel_args passes the
        # table, so a kernel launched through arguments kept past close() (or past this
        # fence) writes a record that still exists.
        table = memory.keep_alive(view.cell_ptrs, self._record)
        self._kernel_args: tuple[torch.Tensor, int, int, int, int] | None = (
            table,
            self.cell,
            view.local_index,
            self.timeout_ns,
            self.record,
        )
        epoch = self.cell + cells.EPOCH
        self._epoch_word: torch.Tensor | None = buf.cell_memory()[epoch : epoch + 8].view(torch.int64)
        self._failure = view.failure
        self._failure.register(self, f"channel {channel}")
        self._side: _ForkJoin | None = None
        self._buffer = buf
        self._streams = caps.streams
        self._host_checks = caps.host_checks_status
        # One launcher per kind of the op (symmsync.ops.fence_op), indexed by it: (arrive, wait).
        kinds = {fence_ops.FENCE: (True, True), fence_ops.ARRIVE: (True, False), fence_ops.WAIT: (False, True)}
        self._launchers = [
            Launcher(_fence_kernel, (1,), num_warps=1, SIZE=view.size, ARRIVE=arrive, WAIT=wait, TRAP=caps.traps)
            for _kind, (arrive, wait) in sorted(kinds.items())
        ]
        self._launch = [launcher.bind(*self._kernel_args) for launcher in self._launchers]
        # The refusal marks (cells.refused_offset): a refused part of an epoch (refuse()), read by
        # refusals(); this rank's cell from its epoch to its last mark, and the epoch the marks
        # were last read up to (the epoch at construction: marks older than this fence are not its).
        self._refused_at = cells.refused_offset(buf.world_size)
        self._refuse: Any = None
        self._cell_words = buf.cell_memory()[self.cell : self.cell + cells.cell_bytes(buf.world_size)].view(torch.int64)
        self._refusals_seen = int(self._epoch_word.item())
        self.op_handle = handles.register(self)
        """The int that names this fence to the op ``symmsync::fence`` (:mod:`symmsync.ops.fence_op`)."""
        # Views, made here: aot_autograd refuses a base among mutated views of it as graph inputs.
        self._order_views = [fence_ops.user_views(buf)[r] for r in view.ranks]

    @property
    def kernel_args(self) -> tuple[torch.Tensor, int, int, int, int]:
        """What a kernel takes to fence on this channel: ``(ptrs, cell, me, timeout_ns, record)``.

        ``view.cell_ptrs`` (the cells' own table, never ``view.ptrs``), :attr:`cell`,
        ``view.local_index``, :attr:`timeout_ns` and :attr:`record`, in the order of
        :func:`symmsync.language.grid_fence` and :func:`symmsync.language.wait_or_trap`
        (``SIZE`` is ``view.size``)::

            my_kernel[grid](*fence.kernel_args, ..., SIZE=view.size)

        Arguments kept past ``close()`` stay safe to launch: the table holds the cells it
        names and this fence's record alive (also once the fence is gone), and a wait
        through them after ``close()`` fails closed, never passes
        (:meth:`~symmsync.SymmetricBuffer.close`). Raises :class:`~symmsync.ClosedError`
        when asked after ``close()``.
        """
        if self._kernel_args is None:
            self._check_usable()
        return self._kernel_args

    @property
    def kernel_kwargs(self) -> dict[str, Any]:
        """:attr:`kernel_args` by the names :mod:`symmsync.language`'s examples give them: ``cells``,
        ``cell``, ``me``, ``timeout_ns``, ``record`` (for a launch bound by name,
        :meth:`symmsync.Consumer.bind`)."""
        return dict(zip(("cells", "cell", "me", "timeout_ns", "record"), self.kernel_args))

    # ------------------------------------------------------------------ operations
    def fence(self) -> None:
        """Advance the epoch, publish it, wait for every member: one launch."""
        if torch.compiler.is_compiling():
            return fence_ops.fence_op(self.op_handle, fence_ops.FENCE, self.orders())
        self.launch_now(fence_ops.FENCE)

    def arrive(self) -> None:
        """Advance the epoch and publish it (first half of a split fence)."""
        if torch.compiler.is_compiling():
            return fence_ops.fence_op(self.op_handle, fence_ops.ARRIVE, self.orders())
        self.launch_now(fence_ops.ARRIVE)

    def wait(self) -> None:
        """Wait until every member published this rank's current epoch (second half)."""
        if torch.compiler.is_compiling():
            return fence_ops.fence_op(self.op_handle, fence_ops.WAIT, self.orders())
        self.launch_now(fence_ops.WAIT)

    def refuse(self) -> None:
        """Take part in the next epoch as :meth:`fence` does, with this rank's part marked refused.

        For a consumer whose call failed its checks on this rank: the call still advances the
        epoch, publishes and waits like a fence (the members' epochs stay in step, and nobody
        waits for a call this rank never makes), and before its publish it stores the mark
        that each member's :meth:`refusals` reads once its own wait for that epoch passed
        (``cell + refused_offset``: docs/fences.md). One launch, eager only; a wait that fails
        fails as :meth:`fence` does."""
        if not self._failure.clean:
            self._check_usable(operation=True)
        if self._refuse is None:
            self._refuse = Launcher(
                _refuse_kernel, (1,), num_warps=1, SIZE=self.view.size, TRAP=self._buffer.capabilities.traps
            ).bind(*self.kernel_args, self._refused_at)
        self._refuse()
        if self._host_checks:
            self.check()

    def refusals(self) -> list[tuple[int, int]]:
        """The members' refused parts (:meth:`refuse`) of the epochs this rank has waited for since
        the last call (since construction, at first), as ``(global rank, epoch)`` in epoch order.

        An epoch this rank refused too is left out (its own error says enough). On GPUs this waits
        for the device first (:meth:`synchronize`: a failed wait raises its error instead). Marks
        of an epoch this rank has not reached yet are kept for a later call."""
        self._check_usable()
        if self._streams:
            self.synchronize()
        words = self._cell_words.tolist()
        epoch = words[cells.EPOCH // 8]
        seen, self._refusals_seen = self._refusals_seen, epoch
        at, me = self._refused_at // 8, self.view.local_index
        own = words[at + 2 * me : at + 2 * me + 2]
        found = [
            (v, self.view.ranks[j])
            for j in range(self.view.size)
            if j != me
            for v in words[at + 2 * j : at + 2 * j + 2]
            if seen < v <= epoch and v not in own
        ]
        return [(rank, v) for v, rank in sorted(found)]

    def orders(self) -> list[torch.Tensor]:
        """What the compiled op takes (:mod:`symmsync.ops.fence_op`): the members' user regions, whose
        plain writes earlier in a traced graph the op's fake refuses."""
        return self._order_views

    @contextlib.contextmanager
    def overlap(self) -> Iterator[None]:
        """Fence concurrently with the work in the ``with`` body.

        On GPUs the fence runs on a side stream that starts after the current stream's
        earlier work (the payload) and that the current stream waits for at the end of
        the block, so neither the publish nor the wait sits between the body's kernels
        (in a CUDA graph: a fork and a join). Use it when the body does not read peer
        data. On the host backend it is ``arrive()`` before the body, ``wait()`` after.
        """
        if not self._streams:
            self.arrive()
            yield
            self.wait()
            return
        if self._buffer.closed:
            self._check_usable(operation=True)
        if self._side is None:
            self._side = _ForkJoin(self._buffer.device)
        side = self._side
        main = side.fork()
        if self._launch[fence_ops.FENCE].packed and not torch.compiler.is_compiling():
            self.launch_now(fence_ops.FENCE, side.raw)
        else:  # the first launch compiles through Triton, which launches on the current stream
            with torch.cuda.stream(side.stream):
                self.fence()
        yield
        side.join(main)

    def launch_now(self, kind: int, stream: int | None = None) -> None:
        """Launch ``kind`` (``fence_op.FENCE``, ``ARRIVE`` or ``WAIT``) now, on ``stream`` (default: the
        current one): what :meth:`fence`, :meth:`arrive` and :meth:`wait` run eagerly, and the op
        ``symmsync::fence`` runs when a compiled graph calls it."""
        # The eager hot path: a few attribute reads and one cuLaunchKernel (benchmarks/fence.py).
        # A closed buffer's views are never clean (close() aborts them first).
        if not self._failure.clean:
            self._check_usable(operation=True)
        self._launch[kind](stream=stream)
        if self._host_checks:
            self.check()

    def _check_usable(self, operation: bool = False) -> None:
        if self._buffer.closed:
            raise ClosedError(f"rank {self.view.rank}: Fence(channel={self.channel}) used after its buffer was closed")
        # After this rank's own fence error, an operation aborts the view first (once), then raises.
        self._failure.check(self, operation)

    def release_tables(self) -> None:
        """Drop the buffer's tables this fence holds (the buffer's ``close()`` calls it, through
        the view's failure owner): its kernel arguments, bound launches and epoch word."""
        self._kernel_args = None
        self._launch = []
        self._refuse = None
        self._epoch_word = None
        self._cell_words = None

    def check_usable(self) -> None:
        """Raise if this fence cannot take part in another operation; cheap when it can.

        Raises :class:`~symmsync.ClosedError` after its buffer was closed, and this rank's
        earlier fence error after one (telling the view's members first, as an operation
        would: see :meth:`abort`). For kernels that fence inside themselves (a fused
        writer's tail) and so do not pass through :meth:`fence`.
        """
        if not self._failure.clean:  # a closed buffer's views are never clean
            self._check_usable(operation=True)

    def abort(self, reason: str) -> None:
        """Give up on this fence's view: every member's wait returns at once with
        :class:`~symmsync.PeerAborted` naming this rank and ``reason``.

        The same as ``self.view.abort(reason)`` (every channel of the view is marked);
        afterwards every fence of this rank on the view raises at once. Idempotent. Call it
        when this rank raises inside an operation its peers take part in, before raising.
        """
        self.view.abort(reason)

    def abort_error(self, reason: str) -> PeerAborted:
        """The :class:`~symmsync.PeerAborted` this fence raises once this rank aborted its
        view with ``reason`` (its part of :class:`symmsync.core.failure.Waiter`)."""
        return used_after_abort(self.view, "fence", reason, self.channel)

    # ------------------------------------------------------------------ state
    @property
    def epoch(self) -> int:
        """This rank's device epoch: the number of arrivals on this channel so far."""
        self._check_usable()
        if self._streams:
            self.synchronize()
        return int(self._epoch_word.item())

    @property
    def launch_path(self) -> str:
        """How the last fence launch went: ``"cuda-python"`` or ``"triton"``."""
        return self._launchers[fence_ops.FENCE].path

    def check(self) -> None:
        """Raise :class:`~symmsync.FenceTimeout` if a wait of this fence timed out (its
        record as it is now; it stays this fence's error: see :meth:`check_usable`)."""
        self._failure.settle(self, self.timeout_error, synchronize=False)

    def synchronize(self) -> None:
        """Wait for the device; turn a trapped fence timeout into :class:`~symmsync.FenceTimeout`."""
        self._failure.settle(self, self.timeout_error)

    def timeout_error(self) -> SymmSyncError | None:
        """The :class:`~symmsync.FenceTimeout` (or :class:`~symmsync.PeerAborted`) that this
        fence's record describes, if a wait failed; the :class:`~symmsync.IndexCheckError`
        when a kernel passed a member index out of range with this fence's record."""
        words = self._record.tolist()
        misuse = records.read_misuse_record(words)
        if misuse is not None:
            return records.misuse_error(misuse, self.view.rank, "fence")
        rec = records.read_fence_record(words)
        if rec is None:
            return None
        epoch, me = rec.epoch, rec.index
        ranks = self.view.ranks
        if rec.aborted and rec.aborter == me:  # a wait for an epoch past close()'s: kept arguments
            why = cells.decode_reason(rec.reason, closed=CLOSED_REASON)
            msg = (
                f"rank {ranks[me]}: fence on view {list(ranks)} channel {self.channel}: a wait for epoch {epoch} "
                f"through kernel arguments kept past close() ({why}) failed at once without reading a slot. "
                "Take kernel_args from a live fence"
            )
            return PeerAborted(
                msg, rank=ranks[me], epoch=epoch, late={}, channel=self.channel, aborted={ranks[me]: why}
            )
        late: dict[int, int] = {}
        aborted: dict[int, str] = {}
        counts: dict[int, int] = {}
        # The recorded reason may be a relay: the member whose flag the wait saw first gave up
        # after another member's abort, and its cell names that origin (cells.REASON_RELAYED).
        first_why = cells.decode_reason(rec.reason, closed=CLOSED_REASON)
        origin = cells.reason_origin(rec.reason)
        relayed_by = None
        for i, slot in enumerate(rec.slots):
            count = slot & cells.COUNT_MASK
            if i == me or count >= epoch:
                continue  # arrived: its data is valid even if it aborted afterwards
            counts[ranks[i]] = count
            if slot < 0 and i == rec.aborter and origin is not None and origin != ranks[i]:
                relayed_by = ranks[i]  # named below as the relay of the origin's abort
            elif slot < 0:  # the abort flag
                aborted[ranks[i]] = first_why if i == rec.aborter else "(aborted too; its reason was not recorded)"
            else:
                late[ranks[i]] = count
        if relayed_by is not None:
            aborted.pop(origin, None)
            aborted = {origin: first_why, **aborted}
        where = f"rank {ranks[me]}: fence on view {list(ranks)} channel {self.channel}"
        parts = []
        for r, why in aborted.items():
            slot = f"its slot holds epoch {counts[r]}" if r in counts else "it had arrived"
            if r == origin and relayed_by is not None:
                slot = f"{slot}; relayed by rank {relayed_by}, whose slot holds epoch {counts[relayed_by]}"
            if why == CLOSED_REASON:
                parts.append(f"rank {r} closed its buffer ({slot})")
            else:
                parts.append(f"rank {r} aborted ({slot}): {why}")
        if late:
            who = ", ".join(f"rank {r} (its slot holds epoch {v})" for r, v in late.items())
            parts.append(f"not published, neither closed nor aborted: {who}")
        if aborted:
            msg = (
                f"{where} gave up waiting for epoch {epoch}: " + "; ".join(parts) + ". Those ranks stopped before "
                "this fence (see their logs for the cause); nothing after it ran."
            )
            return PeerAborted(msg, rank=ranks[me], epoch=epoch, late=late, channel=self.channel, aborted=aborted)
        own = rec.slots[me] & cells.COUNT_MASK if 0 <= me < len(rec.slots) else epoch
        if own < epoch:
            # This rank's own launch reached the wait without publishing: the cause is in the launch
            # (a counter of its arrivals), not in an absent member, and the members may be alike.
            cause = (
                f"this rank did not publish epoch {epoch} itself (its epoch counter holds {own}): its launch "
                "reached the wait without publishing, so the launch's own arrivals are at fault (an arrival "
                "counter holding bits that are not this launch's, or programs of the launch not all resident), "
                "and the ranks named may be in the same state"
            )
            parts.insert(0, cause)
            tail = (
                ". A rank named has not published this epoch either: it did not arrive, or its launch did not publish"
            )
        else:
            tail = (
                ". Those ranks have not published this epoch: they did not reach this fence (crashed, hung, or took "
                "another path), or reached it and did not publish"
            )
        msg = (
            f"{where} timed out after {self.timeout_s:g} s waiting for epoch {epoch}; "
            + ("; ".join(parts) or "no member was missing when the record was written")
            + tail
            + "; nothing after it ran."
        )
        return FenceTimeout(msg, rank=ranks[me], epoch=epoch, late=late, channel=self.channel)

    def __repr__(self) -> str:
        return f"Fence(view={list(self.view.ranks)}, channel={self.channel}, backend={self.backend})"


class _ForkJoin:
    """A side stream that forks from the current stream and joins it again (GPU).

    Two events made once and reused, recorded and waited on through the driver: eager,
    a fork or a join costs two driver calls, where ``Stream.wait_stream`` makes a fresh
    event each time and a stream context switch queries and sets the current stream
    (several times a launch's host time: docs/performance.md, "Fence.overlap()"). In a
    CUDA graph capture the record and the wait become the graph's fork and join edges,
    as torch's would. Streams are named to the driver through :func:`symmsync.core.launch.cu_stream`.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.raw = self.stream.cuda_stream
        self.index = device.index
        self.drv = cuda.driver() if cuda.available() else None
        if self.drv is None:  # cuda-python missing: torch's events do the same, slower
            self.fork_event, self.join_event = torch.cuda.Event(), torch.cuda.Event()
            return
        flags = self.drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        events = []
        for _ in range(2):
            ev = cuda.check(self.drv.cuEventCreate(flags), "cuEventCreate", call=_OVERLAP)
            events.append(ev)
            weakref.finalize(self, self.drv.cuEventDestroy, ev)
        self.fork_event, self.join_event = events

    def fork(self) -> int:
        """Make the side stream wait for the current stream's work so far; return that stream."""
        main = current_stream(self.index)
        drv = self.drv
        if drv is None:
            cur = torch.cuda.current_stream(self.index)
            self.fork_event.record(cur)
            self.stream.wait_event(self.fork_event)
            return main
        cuda.check(drv.cuEventRecord(self.fork_event, cu_stream(main)), "cuEventRecord", call=_OVERLAP)
        cuda.check(drv.cuStreamWaitEvent(cu_stream(self.raw), self.fork_event, 0), "cuStreamWaitEvent", call=_OVERLAP)
        return main

    def join(self, main: int) -> None:
        """Make stream ``main`` wait for the side stream's work so far."""
        drv = self.drv
        if drv is None:
            self.join_event.record(self.stream)
            torch.cuda.ExternalStream(main, device=torch.device("cuda", self.index)).wait_event(self.join_event)
            return
        cuda.check(drv.cuEventRecord(self.join_event, cu_stream(self.raw)), "cuEventRecord", call=_OVERLAP)
        cuda.check(drv.cuStreamWaitEvent(cu_stream(main), self.join_event, 0), "cuStreamWaitEvent", call=_OVERLAP)


fence_ops.serve(Fence)  # the class whose objects symmsync::fence runs

_OVERLAP = "Fence.overlap"  # the operation a failed driver call of _ForkJoin is reported under


def launch_grid_sync(kernel: Any, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` (which calls :func:`symmsync.language.grid_sync`) once its programs
    are known to be co-resident.

    Every program of such a kernel spins until the last one arrived, so all must be
    resident on the device together. On GPUs the kernel is compiled first and the grid is
    checked against the SM count times the blocks per SM the driver's occupancy calculator
    gives for the compiled kernel; on the host backend the interpreter runs programs one
    after another, so only a launch of one program can hold.

    Args:
        kernel: the ``@triton.jit`` kernel.
        grid: the launch grid (up to 3 ints).
        *args: the kernel's arguments, as for ``kernel[grid](*args, **kwargs)``.
        **kwargs: its keyword arguments (constexprs, ``num_warps``).

    Raises:
        ConfigError: the grid cannot be co-resident here (nothing is launched).
    """
    grid = tuple(grid)
    programs = math.prod(grid)
    rank = dist.get_rank() if dist.is_initialized() else 0
    call = "launch_grid_sync"
    if kernels_interpreted():
        if programs > 1:
            raise ConfigError(
                f"rank {rank}: {call}: a grid of {programs} programs on the host backend: Triton's interpreter "
                "runs programs one after another, so they can never wait for each other; launch one program here"
            )
    else:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        per_sm, sms = _occupancy(compiled, kwargs.get("num_warps", 4))
        if programs > per_sm * sms:
            raise ConfigError(
                f"rank {rank}: {call}: a grid of {programs} programs cannot be co-resident: the device holds "
                f"{per_sm} such program(s) per SM on {sms} SMs ({per_sm * sms} at once); a program that waits for "
                f"the others would spin until the budget runs out. Launch at most {per_sm * sms} programs "
                "(loop inside the kernel over the rest)"
            )
    kernel[grid](*args, **kwargs)


def _occupancy(compiled: Any, num_warps: int) -> tuple[int, int]:
    """(programs per SM, SMs) for a compiled kernel on the current device."""
    from ..backends.driver import check, driver

    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    compiled._init_handles()
    warps = getattr(compiled, "num_warps", None) or compiled.metadata.num_warps or num_warps
    shared = getattr(compiled.metadata, "shared", 0)
    drv = driver()
    per_sm = check(
        drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            drv.CUfunction(init_value=compiled.function), 32 * warps, shared
        ),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        call="launch_grid_sync",
    )
    return int(per_sm), sms
