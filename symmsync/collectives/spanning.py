"""The collectives over a view whose members span nodes: node steps, and one step between nodes.

No kernel can address another node's memory, so over a view that spans nodes
(``view.nodes.num_nodes > 1``) an operation is made of steps: today's kernels over the
view's *node view* (this rank's node's members of the view), and one exchange among the
members at the same position of every node, the view's
:class:`~symmsync.spanning.exchange.OffNode`. Both are the view's own
(:mod:`symmsync.spanning.parts`), shared by every consumer over it; each collective takes
its node steps' fence channels of the node view in the order the consumers are made.
``AllReduce(view, ...)`` over such a view makes its form here (:data:`FORMS`, by operation):
the same object, calls, argument checks, agreement and failure contract; its checked call
runs the form's steps instead of one kernel. With ``N`` nodes of ``m`` members, this rank at
position ``p`` of node ``j``::

    AllReduce(x), k elements, c = ceil(k / m):
        1. node ReduceScatter of x (padded to m * c): chunk p of this node's partial sum
           (its members in member order, summed in float32, rounded to the dtype)
        2. the exchange among="position" of [this call's header | chunk p]: every node's
           chunk p, and the calls compared (they must be alike on every node)
        3. here: acc = float32(part_0); acc += float32(part_i), i = 1 .. N-1 (node order);
           chunk p of the sum = dtype(acc), the same bits at position p of every node
        4. node AllGather of the chunks: the whole sum, on every member
    AllGather(x):
        1. the exchange of [header | x]: x of the members at position p, node order
        2. node AllGather of those N * k elements; then each member's block put in view order
    ReduceScatter(x), n * c elements (n = N * m; member i gets chunk i):
        1. node ReduceScatter of x's chunks reordered: position p gets this node's partial of
           the chunks of every node's member at position p
        2. the exchange of [header | those N chunks]
        3. here: this member's chunk of each node's partial, summed as in AllReduce's step 3

Each call crosses nodes once: its header travels with its data in one frame of a fixed size
(the header's words, then room for the largest call's bytes), so that members whose calls
differ never meet exchanges of different sizes, and the headers are compared in one place
(:meth:`_NodeSteps._between_nodes`), after the exchange, before any received byte is used.

The fused residual + RMS norm runs its epilogue in torch after step 4, with the arithmetic
of :meth:`AllReduce.__call__ <symmsync.collectives.AllReduce.__call__>`. The elements a member
receives go through the off-node step as bytes (any dtype, any backend).

A bad input fails that call only (:meth:`_NodeSteps.refuse`): the refusing member posts a
record (:mod:`symmsync.spanning.refusals`) and runs every step refused, each member that meets
the refusal runs the rest of its steps refused, and every member raises
:class:`~symmsync.PeerRefused` naming the refusing member by the end of its call.

Failure: a step that raises fails the collective for good (as one kernel's failure does)
and aborts the view, which the exchange posts where the other nodes' members read it; the
view's parts pass the abort to the node view (:mod:`symmsync.spanning.parts`), so that this
node's members waiting in a node step raise :class:`~symmsync.PeerAborted` at once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import index_problem, timeout_problem
from ..core.nodes import NodeLayout
from ..core.views import PeerView
from ..errors import PeerRefused, SymmSyncError, peer_refused
from ..spanning import exchange
from ..spanning import parts as spanning
from ..spanning.refusals import Refusals
from . import layout as L
from . import making
from .mismatch import differing_calls
from .operations import FORMS, AllGather, ReduceScatter

_STEP_CLASSES = {L.REDUCE_SCATTER: ReduceScatter, L.ALL_GATHER: AllGather}
_HEADER_BYTES = L.HEADER_WORDS * 8


def layout_problem(nodes: NodeLayout, channels: int, steps: int) -> str | None:
    """Why a collective of ``steps`` node steps cannot span ``nodes`` with ``channels`` channels
    of the node view left, or ``None``."""
    if not nodes.uniform:
        return (
            f"the view's members are spread unevenly over its nodes ({nodes}); a collective across nodes "
            "needs as many members on every node (its step between nodes pairs the members at each position): "
            "make the view of as many ranks of each node"
        )
    if steps > channels:
        return (
            f"its node steps take {steps} fence channels of the view's node view, and {channels} are left (the "
            "consumers over this view took the others): pass channels= to SymmetricBuffer for more"
        )
    return None


class _NodeSteps:
    """An operation's form over a view that spans nodes: its node steps and a call's frame.

    Made by the operation's constructor (``AllReduce(view, ...)``), which keeps it and runs
    :meth:`launch` as its checked call's launch. Each operation's form defines :meth:`_run`.

    Attributes:
        node_view: the view's node view (:mod:`symmsync.spanning.parts`).
        steps: the collectives over :attr:`node_view` the calls run, in order
            (:func:`~symmsync.collectives.layout.node_steps`).
        exchange: the view's :class:`~symmsync.spanning.exchange.OffNode`.
        make: the agreed construction (:class:`~symmsync.core.consumer.Making`; it claims no bytes:
            the steps hold them).
    """

    def __init__(
        self,
        owner: Any,
        view: PeerView,
        max_numel: int,
        dtype: torch.dtype,
        algorithm: str | None,
        offset: int,
        channel: int,
        timeout_s: float | None,
    ):
        name, op = owner.NAME, owner._OP
        make = making.start(name, view, max_numel, dtype, algorithm, offset)
        buf, nodes = make.buffer, view.nodes
        plan: tuple[tuple[int, int], ...] = ()
        if make.ok:
            plan = L.node_steps(op, max_numel, dtype, view.size, nodes.num_nodes)
            make.check(
                layout_problem(nodes, spanning.channels_left(view), len(plan))
                or index_problem("channel", channel, buf.cells.channels, "each view")
                or (timeout_problem(timeout_s) if timeout_s is not None else None)
            )
        if make.ok:
            m = view.size // nodes.num_nodes
            nbytes = sum(L.Workspace.plan(0, n, dtype, m, reduced=False).nbytes for _, n in plan)
            making.fits(make, offset, nbytes, nodes.num_nodes)
        mine = making.arguments(max_numel, dtype, algorithm, offset, channel)
        first = "" if spanning.made(view) else ", making the view's node view"
        making.agree(make, mine, steps=name + first)
        self.make = make
        parts = spanning.parts_of(view, timeout_s=timeout_s)
        self.node_view, self.exchange = parts.node_view, parts.exchange
        steps, at = [], offset
        for c, (step, n) in zip(parts.take_channels(len(plan)), plan):
            steps.append(_STEP_CLASSES[step](self.node_view, n, dtype, offset=at, channel=c, timeout_s=timeout_s))
            at += steps[-1].workspace.nbytes
        self.steps: tuple[Any, ...] = tuple(steps)
        self._owner, self._name, self._op = owner, name, op
        self._budget = steps[0].fence.timeout_s
        self._nodes = nodes.num_nodes
        #: Where a member's refused call is told (:meth:`refuse`), and whether this call is refused.
        self._refusals = Refusals(view, buf.rank, name)
        self._refused = False
        self._streams = buf.capabilities.streams  # a GPU: a node step's refusal is read before the exchange
        self._members = len(self.node_view.ranks)  # m: the members of each node
        self._node = nodes.node_of(view.local_index)
        self._position_ranks = [view.ranks[i] for i in nodes.peers_at(nodes.position(view.local_index))]
        self._calls = 0  # calls made: the number in a call's header
        max_bytes = self._max_bytes = max_numel * dtype.itemsize
        self.limits = {d: max_bytes // d.itemsize for d in L.DTYPES}
        # The frame of a call: its header, then room for the largest payload this form sends
        # (the all-gather: x; the others: one of m chunks, rounded up to an element).
        room = max_bytes if op == L.ALL_GATHER else -(-max_bytes // self._members) + 8
        self._frame = torch.zeros(_HEADER_BYTES + room, dtype=torch.uint8, device=buf.device)
        # Where position p's block of node j goes: row p * N + j of a node all-gather of the
        # position exchange holds member nodes[j][p]'s (all-gather; the reduce-scatter's inverse).
        order = [node[p] for p in range(self._members) for node in nodes.nodes]
        self._by_position = torch.tensor(order, dtype=torch.int64, device=buf.device)
        self._by_member = torch.argsort(self._by_position)

    def input_memory(self) -> torch.Tensor:
        """The bytes the operation's :meth:`input` hands out: this rank's, no peer reads them (the steps copy them)."""
        return torch.empty(self._max_bytes, dtype=torch.uint8, device=self._frame.device)

    # ------------------------------------------------------------------ a call
    def launch(self, x: torch.Tensor, out: torch.Tensor, numel: int, algorithm: int, count: int, epilogue) -> None:
        """The checked call's steps (the operation made every check of one kernel's call); a
        failure of any fails the collective and aborts the view."""
        owner = self._owner
        if not owner._failure.clean or owner.buffer.closed:
            owner.check_usable()
        symmetric = int(x.data_ptr() == owner._sym_addr)
        row = 0 if epilogue is None else epilogue["hidden"]
        words = L.header(self._op, numel, L.DTYPES[x.dtype], algorithm, symmetric, 0, row)  # the call's number: _call
        self._call(x.device, None, words, x, out, numel, count, epilogue)
        if self._refused:  # a member refused this call: every step ran refused from where it was seen
            out.fill_(float("nan"))  # a refused call's outputs read NaN, as one kernel's do
            if epilogue is not None:
                epilogue["res_out"].fill_(float("nan"))
            self._raise_refused(seen_in_call=True)

    def refuse(self, problem: str) -> None:
        """This rank's call failed its checks: post the refusal (:class:`~symmsync.spanning.refusals.Refusals`),
        then take part in every step of the call refused: each node step as a refused call (its
        members' node steps do nothing and raise :class:`~symmsync.PeerRefused`, which makes their
        call refused from there on), the exchange with the header's ``numel`` -1 (the members at
        this position learn it there). So every member of the view meets the refusal by the end
        of its call (on a GPU some at :meth:`synchronize`), every step's epochs stay in step, and
        no member's output is written. The caller raises this rank's own error."""
        words = L.header(self._op, -1, 0, 0, 0, 0, 0)
        self._call(self._owner.buffer.device, problem, words, None, None, 0, 0, None)

    def _call(self, device: torch.device, problem: str | None, words: list[int], *args: Any) -> None:
        """One call's steps (:meth:`_run` of ``args`` and the header ``words``, given the call's number), refused
        from the start where ``problem`` is this rank's; a failure of any step fails the collective
        and aborts the view."""
        owner = self._owner
        self.exchange.refuse_capture(device, f"{self._name} over a view that spans {self._nodes} nodes")
        try:
            self._calls += 1
            self._refused = problem is not None
            if problem is not None:
                self._refusals.post(self._calls, problem)
            words[L.H_EPOCH] = self._calls
            self._run(*args, words)
        except Exception as e:
            err = self._named(e)
            owner.fail(err)
            if err is e:
                raise
            raise err from e

    def _raise_refused(self, seen_in_call: bool = False) -> None:
        """Raise :class:`~symmsync.PeerRefused` for the members' refused calls of this rank's calls so
        far (:class:`~symmsync.spanning.refusals.Refusals`), naming the refusing member and its problem.
        ``seen_in_call``: this rank's own call (not refused by it) met the refusal, so a record must
        be there; none found (the store lost it) still fails the call, naming no member."""
        found = self._refusals.read(self._calls)
        owner = self._owner
        if not found and seen_in_call:  # fail closed: the call did not run, whatever the store says
            found = [(-1, self._calls, "unknown: its record is not in torch.distributed's store", "")]
        if not found:  # this rank refused the call too: its own error says enough
            return
        origin, number, problem, _ = found[0]
        when = f"call {number}, across {self._nodes} nodes"
        outcome = "no member's call did anything (its outputs hold NaN), and the next call goes on"
        raise peer_refused(owner.rank, self._name, owner.view.ranks, when, origin, "call", problem, outcome)

    def _step(self, step: Any, *args: Any, before_exchange: bool = False, **kwargs: Any) -> torch.Tensor | None:
        """A node step of this call: ``step(*args, **kwargs)``, or, once the call is known refused, the
        step as a refused call (``None``). A member's refusal of the step makes the call refused
        (``None``); on a GPU a step ``before_exchange`` is waited for, so that its refusal is known
        before this rank's header goes out."""
        if self._refused:
            step.launch_refused()
            return None
        try:
            result = step(*args, **kwargs)
            if before_exchange and self._streams:
                step.synchronize()
        except PeerRefused:
            self._refused = True
            return None
        return result

    def _named(self, e: Exception) -> Exception:
        """A step's error as naming the view's origin (:func:`symmsync.spanning.exchange.as_origin`)."""
        return exchange.as_origin(self._owner.view, self._owner.rank, self._name, e)

    def _run(self, x, out, numel, count, epilogue, words: list[int]) -> None:
        """The form's steps of a checked call, ``words`` its header (each form defines its own)."""
        raise NotImplementedError

    def _between_nodes(self, t: torch.Tensor | None, words: list[int]) -> list[torch.Tensor] | None:
        """``t`` of the member at this rank's position on every node, in node order: the one
        exchange of a call, ``[header | t]`` in a frame of fixed size. The members' headers are
        compared here, before any received byte is used: calls that differ raise
        :class:`~symmsync.collectives.CollectiveMismatch` on every member of the exchange. ``None``
        where the call is refused (this rank's, or a member's header at this position says so)."""
        frame = self._frame
        if self._refused:  # the header says so (numel -1); no data
            t, words = None, [-1 if i == L.H_NUMEL else w for i, w in enumerate(words)]
        frame[:_HEADER_BYTES].copy_(torch.tensor(words, dtype=torch.int64).view(torch.uint8))
        if t is not None:
            nbytes = t.numel() * t.element_size()
            frame[_HEADER_BYTES : _HEADER_BYTES + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        got = self.exchange.all_gather(frame, among="position", timeout_s=self._budget)
        headers = torch.stack([g[:_HEADER_BYTES] for g in got]).view(torch.int64).tolist()  # one copy to the host
        if t is None or any(h[L.H_NUMEL] < 0 for h in headers):  # refused here, or by a member at this position
            self._refused = True
            return None
        if any(h != words for h in headers):
            owner = self._owner
            where = f"rank {owner.rank}: {self._name} on view {list(owner.view.ranks)} (call {self._calls})"
            raise differing_calls(
                where, dict(zip(self._position_ranks, headers)), owner.rank, self._calls, " across nodes"
            )
        return [g[_HEADER_BYTES : _HEADER_BYTES + nbytes].view(t.dtype) for g in got]

    def _node_order_sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The nodes' partials summed in float32 in node order (the rounding is the caller's)."""
        acc = parts[0].to(torch.float32, copy=True)
        for q in parts[1:]:
            acc += q  # float32 += dtype: q converted exactly, then one float32 addition
        return acc

    def synchronize(self) -> None:
        """Wait for the device and raise a node step's recorded error (GPUs), which fails the
        collective too; the step between nodes raises in the call itself."""
        refused = False
        try:
            for step in self.steps:
                try:
                    step.synchronize()
                except PeerRefused:  # a member's refused call reached this node step: named from the record
                    refused = True
        except SymmSyncError as e:
            err = self._named(e)
            self._owner.fail(err)
            if err is e:
                raise
            raise err from e
        if refused:
            self._raise_refused()


class _AllReduceSteps(_NodeSteps):
    def input_memory(self) -> torch.Tensor:
        # The node reduce-scatter's symmetric input: a call that passes it and needs no padding copies nothing.
        rs = self.steps[0]
        return rs.input(rs.max_numel, rs.dtype).view(torch.uint8)

    def _run(self, x, out, numel, count, epilogue, words) -> None:
        if epilogue is None:
            self._sum(x, numel, out, words)
            return
        residual, weight, res_out, eps = epilogue["residual"], epilogue["weight"], epilogue["res_out"], epilogue["eps"]
        s = self._sum(x, numel, None, words)
        if s is None:
            return
        new = s.view(x.shape).to(torch.float32) + residual.to(torch.float32)
        res_out.copy_(new)  # rounds to the dtype: what torch's s + residual gives
        h = res_out.to(torch.float32)
        out.copy_(h / torch.sqrt(h.square().mean(-1, keepdim=True) + eps) * weight.to(torch.float32))

    def _sum(self, x: torch.Tensor | None, numel: int, out: torch.Tensor | None, words: list[int]) -> Any:
        """The sum over the members (steps 1 to 4), into ``out`` (a new 1-D tensor when ``None``);
        ``None`` for a refused call (known to every member after step 2: each position's exchange
        holds a member of the refusing member's node, so step 4 is left out on every member)."""
        rs, ag = self.steps
        if self._refused:  # this rank refused the call: no data
            self._between_nodes(self._step(rs), words)
            return None
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
        parts = self._between_nodes(self._step(rs, src, before_exchange=True), words)
        if parts is None:
            return None
        chunk = self._node_order_sum(parts).to(x.dtype)
        if out is not None and numel == m * c:
            return ag(chunk, out=out.view(-1))
        whole = ag(chunk)[:numel]
        if out is None:
            return whole
        return out.view(-1).copy_(whole)


class _AllGatherSteps(_NodeSteps):
    def _run(self, x, out, numel, count, epilogue, words) -> None:
        (ag,) = self.steps
        parts = self._between_nodes(x, words)
        if parts is None:  # refused: the members at this position know; the node all-gather tells the rest
            self._step(ag)
            return
        block = ag.input(self._nodes * numel, x.dtype)
        torch.cat(parts, out=block)
        gathered = self._step(ag, block)
        if gathered is None:
            return
        gathered = gathered.view(self._owner.size, numel)  # row p * N + j: the member at position p of node j
        torch.index_select(gathered, 0, self._by_member, out=out.view(self._owner.size, numel))


class _ReduceScatterSteps(_NodeSteps):
    def _run(self, x, out, numel, count, epilogue, words) -> None:
        (rs,) = self.steps
        if self._refused:  # this rank refused the call: no data
            self._between_nodes(self._step(rs), words)
            return
        size = self._owner.size
        src = rs.input(numel, x.dtype)
        torch.index_select(x.reshape(size, count), 0, self._by_position, out=src.view(size, count))
        parts = self._between_nodes(self._step(rs, src, before_exchange=True), words)  # node i's partials, node order
        if parts is None:
            return
        mine = [q[self._node * count : (self._node + 1) * count] for q in parts]
        out.copy_(self._node_order_sum(mine))


FORMS.update({L.ALL_REDUCE: _AllReduceSteps, L.ALL_GATHER: _AllGatherSteps, L.REDUCE_SCATTER: _ReduceScatterSteps})
