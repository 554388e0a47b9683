"""The collectives over a view whose members span nodes: node steps, and one step between nodes.

No kernel can address another node's memory, so over a view that spans nodes
(``view.nodes.num_nodes > 1``) an operation is made of steps: today's kernels over a
*node view* (this rank's node's members of the view, made at construction with
``buf.view``), and one exchange among the members at the same position of every node
through :class:`symmsync.offnode.OffNode` (torch.distributed: NCCL on GPUs, gloo on CPUs).
``AllReduce(view, ...)`` over such a view makes the class's form here (the constructor
picks it from the view's layout): the same calls, argument checks, agreement and failure
contract. With ``N`` nodes of ``m`` members, this rank at position ``p`` of node ``j``::

    every call:
        0. OffNode.all_gather(header, among="position"): the calls must be alike on every node
    AllReduce(x), k elements, c = ceil(k / m):
        1. node ReduceScatter of x (padded to m * c): chunk p of this node's partial sum
           (its members in member order, summed in float32, rounded to the dtype)
        2. OffNode.all_gather(chunk, among="position"): chunk p of every node's partial
        3. here: acc = float32(part_0); acc += float32(part_i), i = 1 .. N-1 (node order);
           chunk p of the sum = dtype(acc), the same bits at position p of every node
        4. node AllGather of the chunks: the whole sum, on every member
    AllGather(x):
        1. OffNode.all_gather(x, among="position"): x of the members at position p, node order
        2. node AllGather of those N * k elements; then each member's block put in view order
    ReduceScatter(x), n * c elements (n = N * m; member i gets chunk i):
        1. node ReduceScatter of x's chunks reordered: position p gets this node's partial of
           the chunks of every node's member at position p
        2. OffNode.all_gather(among="position") of those N chunks
        3. here: this member's chunk of each node's partial, summed as in AllReduce's step 3

The fused residual + RMS norm runs its epilogue in torch after step 4, with the arithmetic
of :meth:`AllReduce.__call__ <symmsync.collectives.AllReduce.__call__>`. The elements a member
receives go through the off-node step as bytes (any dtype, any backend).

Failure: a step that raises fails the collective for good (as one kernel's failure does)
and aborts the view, which OffNode posts where the other nodes' members read it; an abort
of the view also aborts the node view (:meth:`refuse_kernel_args`), so that this node's
members waiting in a node step raise :class:`~symmsync.PeerAborted` at once.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import handles
from ..checks import index_problem, timeout_problem
from ..errors import ClosedError, SymmSyncError
from ..failure import used_after_abort
from ..nodes import NodeLayout
from ..offnode import OffNode
from ..views import PeerView
from . import layout as L
from . import making
from .mismatch import differing_calls
from .ops import FORMS, AllGather, AllReduce, ReduceScatter, _Collective

_STEP_CLASSES = {L.REDUCE_SCATTER: ReduceScatter, L.ALL_GATHER: AllGather}


def layout_problem(nodes: NodeLayout, channels: int, steps: int) -> str | None:
    """Why a collective of ``steps`` node steps cannot span ``nodes``, or ``None``."""
    if not nodes.uniform:
        return (
            f"the view's members are spread unevenly over its nodes ({nodes}); a collective across nodes "
            "needs as many members on every node (its step between nodes pairs the members at each position): "
            "make the view of as many ranks of each node"
        )
    if steps > channels:
        return f"its node steps take {steps} fence channels of a node view, and the buffer has {channels} per view"
    return None


class _OverNodes(_Collective):
    """What the three forms over nodes share: construction, input(), failures, the call's frame.

    Each form subclasses its operation first, then this class (``class _AllReduce(AllReduce,
    _OverNodes)``): the operation's ``__init__``, ``__call__`` and argument checks run as
    they are, its ``super().__init__`` reaches this constructor, and this class's
    :meth:`_launch` (what the checked call runs) and failure handling replace the kernel's.
    """

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
        buf, problem, error = making.arguments_problem(self._NAME, view, max_numel, dtype, algorithm, offset)
        nodes = view.nodes
        plan: tuple[tuple[int, int], ...] = ()
        if problem is None:
            plan = L.node_steps(self._OP, max_numel, dtype, view.size, nodes.num_nodes)
            problem = (
                layout_problem(nodes, buf.cells.channels, len(plan))
                or index_problem("channel", channel, buf.cells.channels, "each view")
                or (timeout_problem(timeout_s) if timeout_s is not None else None)
            )
        if problem is None:
            m = view.size // nodes.num_nodes
            nbytes = sum(L.Workspace.plan(0, n, dtype, m, reduced=False).nbytes for _, n in plan)
            problem, error = making.fit_problem(buf, offset, nbytes, nodes.num_nodes)
        mine = making.arguments(max_numel, dtype, algorithm, offset, channel)
        self._keep(view, max_numel, dtype, making.agree(self._NAME, view, mine, problem, error, steps=self._NAME))
        me = view.local_index
        self.node_view = buf.view([view.ranks[i] for i in nodes.members_of(me)])
        """The view of this rank's node's members (made collectively at construction): the node steps'."""
        steps, at = [], offset
        for c, (op, n) in enumerate(plan):
            steps.append(_STEP_CLASSES[op](self.node_view, n, dtype, offset=at, channel=c, timeout_s=timeout_s))
            at += steps[-1].workspace.nbytes
        self.steps: tuple[_Collective, ...] = tuple(steps)
        """The collectives over :attr:`node_view` the calls run, in order
        (:func:`~symmsync.collectives.layout.node_steps`)."""
        self.offnode = OffNode(view, timeout_s=steps[0].fence.timeout_s)
        """The step between nodes (:class:`symmsync.offnode.OffNode`), with the node steps' budget."""
        self.fence = self.workspace = None
        self._nodes = nodes.num_nodes
        self._members = len(self.node_view.ranks)  # m: the members of each node
        self._node = nodes.node_of(me)
        self._position_ranks = [view.ranks[i] for i in nodes.peers_at(nodes.position(me))]
        self._calls = 0  # calls made: the number in a call's header
        caps = buf.capabilities
        self._streams = caps.streams
        self._device_index = buf.device.index if caps.streams else -1
        self._limits = {d: max_numel * dtype.itemsize // d.itemsize for d in L.DTYPES}
        self._sym_bytes = self._input_memory(buf, max_numel * dtype.itemsize)
        self._sym_addr = self._sym_bytes.data_ptr()
        # Where position p's block of node j goes: row p * N + j of a node all-gather of the
        # position exchange holds member nodes[j][p]'s (all-gather; the reduce-scatter's inverse).
        order = [node[p] for p in range(self._members) for node in nodes.nodes]
        self._by_position = torch.tensor(order, dtype=torch.int64, device=buf.device)
        self._by_member = torch.argsort(self._by_position)
        self._failure = view.failure
        self._failure.register(self, f"{self._NAME} (over {self._nodes} nodes)")
        self.handle = handles.register(self, self._NAME)

    def _input_memory(self, buf: Any, nbytes: int) -> torch.Tensor:
        """The memory :meth:`input` hands out: this rank's, no peer reads it (the steps copy it)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=buf.device)

    # ------------------------------------------------------------------ a call
    def _launch(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        numel: int,
        algorithm: int,
        count: int = -1,
        epilogue: tuple | None = None,
    ) -> None:
        """The checked call (the operation's ``__call__`` made every check of one kernel's call):
        its steps; a failure of any fails the collective and aborts the view."""
        if not self._failure.clean or self._buffer.closed:
            self._check_usable()
        self.offnode.refuse_capture(x.device, f"{self._NAME} over a view that spans {self._nodes} nodes")
        try:
            self._compare_calls(x, numel, algorithm, epilogue)
            self._steps_of(x, out, numel, count, epilogue)
        except Exception as e:
            self._fail(e)
            raise

    def _compare_calls(self, x: torch.Tensor, numel: int, algorithm: int, epilogue: tuple | None) -> None:
        """Step 0: the members at this rank's position compare their calls' headers (the words
        a kernel's call carries: :mod:`symmsync.collectives.layout`), so that a call that differs
        on another node is refused before anything moves. The node steps compare the calls
        within a node; the exchange between nodes must not meet tensors of different sizes
        (gloo ends the process)."""
        self._calls += 1
        symmetric = int(x.data_ptr() == self._sym_addr)
        row = 0 if epilogue is None else epilogue[3]
        words = [L.TAG + self._OP, numel, L.DTYPES[x.dtype], algorithm, symmetric, self._calls, row, 0]
        mine = torch.tensor(words, dtype=torch.int64, device=self._buffer.device)
        headers = [h.tolist() for h in self.offnode.all_gather(mine, among="position")]
        if any(h != words for h in headers):
            where = f"rank {self.rank}: {self._NAME} on view {list(self.view.ranks)} (call {self._calls})"
            raise differing_calls(
                where, dict(zip(self._position_ranks, headers)), self.rank, self._calls, " across nodes"
            )

    def _steps_of(self, x, out, numel, count, epilogue) -> None:
        """The form's steps 1 to 4 of a checked call (each form defines its own)."""
        raise NotImplementedError

    def _between_nodes(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` of the member at this rank's position on every node, in node order (as bytes)."""
        parts = self.offnode.all_gather(t.reshape(-1).view(torch.uint8), among="position")
        return [q.view(t.dtype) for q in parts]

    def _node_order_sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The nodes' partials summed in float32 in node order (the rounding is the caller's)."""
        acc = parts[0].to(torch.float32, copy=True)
        for q in parts[1:]:
            acc += q  # float32 += dtype: q converted exactly, then one float32 addition
        return acc

    # ------------------------------------------------------------------ failures
    def synchronize(self) -> None:
        """Wait for the device and raise a node step's recorded error (GPUs), which fails this
        collective too; the step between nodes raises in the call itself."""
        try:
            for step in self.steps:
                step.synchronize()
        except SymmSyncError as e:
            self._fail(e)
            raise

    def _check_usable(self) -> None:
        if self._buffer.closed:
            raise ClosedError(f"rank {self.rank}: {self._NAME}: used after its buffer was closed")
        self._failure.check(self)

    def abort_error(self, reason: str) -> Exception:
        return used_after_abort(self.view, self._NAME, reason)

    def refuse_kernel_args(self, reason: str) -> None:
        """This rank aborted the view (:class:`symmsync.failure.Waiter`): the node steps' kernels
        fail closed too. The node view is aborted with the same reason, so that this node's members
        waiting in a node step raise :class:`~symmsync.PeerAborted` naming this rank at once (the
        other nodes' members read the view's abort in the store)."""
        self.node_view.failure.abort_quietly(reason)

    def release_tables(self) -> None:
        """The buffer closed: drop the memory :meth:`input` handed out (the node steps release
        theirs through the node view)."""
        self._sym_bytes = None


class _AllReduce(AllReduce, _OverNodes):
    def _input_memory(self, buf: Any, nbytes: int) -> torch.Tensor:
        # The node reduce-scatter's symmetric input: a call that passes it and needs no padding copies nothing.
        return self.steps[0]._sym_bytes

    def _steps_of(self, x, out, numel, count, epilogue) -> None:
        if epilogue is None:
            self._sum(x, numel, out)
            return
        residual, weight, res_out, _hidden, eps = epilogue
        s = self._sum(x, numel, None)
        new = s.view(x.shape).to(torch.float32) + residual.to(torch.float32)
        res_out.copy_(new)  # rounds to the dtype: what torch's s + residual gives
        h = res_out.to(torch.float32)
        out.copy_(h / torch.sqrt(h.square().mean(-1, keepdim=True) + eps) * weight.to(torch.float32))

    def _sum(self, x: torch.Tensor, numel: int, out: torch.Tensor | None) -> torch.Tensor:
        """The sum over the members (steps 1 to 4), into ``out`` (a new 1-D tensor when ``None``)."""
        rs, ag = self.steps
        m = self._members
        c = -(-numel // m)
        src = x.reshape(-1)
        if numel != m * c:
            # The node reduce-scatter takes m equal chunks: pad x to m * c elements in its symmetric
            # input. The padding is left as it is: every element is summed apart, and the padding's
            # sums are dropped after step 4.
            src = rs.input(m * c, x.dtype)
            if x.data_ptr() != src.data_ptr():
                src[:numel].copy_(x.reshape(-1))
        parts = self._between_nodes(rs(src))
        chunk = self._node_order_sum(parts).to(x.dtype)
        if out is not None and numel == m * c:
            return ag(chunk, out=out.view(-1))
        whole = ag(chunk)[:numel]
        if out is None:
            return whole
        return out.view(-1).copy_(whole)


class _AllGather(AllGather, _OverNodes):
    def _steps_of(self, x, out, numel, count, epilogue) -> None:
        (ag,) = self.steps
        block = ag.input(self._nodes * numel, x.dtype)
        torch.cat(self._between_nodes(x), out=block)
        gathered = ag(block).view(self.size, numel)  # row p * N + j: the member at position p of node j
        torch.index_select(gathered, 0, self._by_member, out=out.view(self.size, numel))


class _ReduceScatter(ReduceScatter, _OverNodes):
    def _steps_of(self, x, out, numel, count, epilogue) -> None:
        (rs,) = self.steps
        src = rs.input(numel, x.dtype)
        torch.index_select(x.reshape(self.size, count), 0, self._by_position, out=src.view(self.size, count))
        parts = self._between_nodes(rs(src))  # node i's partials of the chunks at this position, node order
        mine = [q[self._node * count : (self._node + 1) * count] for q in parts]
        out.copy_(self._node_order_sum(mine))


FORMS.update({AllReduce: _AllReduce, AllGather: _AllGather, ReduceScatter: _ReduceScatter})
