"""The collectives over views that span nodes: 2 simulated nodes x 2 ranks on the host backend.

Every test runs on the session's pool of 4 ranks with ``SYMMSYNC_NODE_SIZE=2`` (tests/conftest.py):
world ranks 0 and 1 are one node, 2 and 3 the other. The oracle states the order of additions of docs/collectives.md
("Across nodes") in plain torch, from the inputs gathered with torch.distributed and the
nodes of that setting (world rank ``w`` on node ``w // 2``, written here, not read from the
library): each node's members summed in float32 in view order and rounded to the dtype, then
the node partials summed in float32 in node order and rounded once. Results must equal it bit
for bit on every member; bfloat16 and float16 inputs of a wide range of magnitudes make the
order matter, and the tests check that the flat member-order sum differs from the oracle there.

* every operation (the all-reduce with both algorithm names and the symmetric input, the
  fused residual + RMS norm, the all-gather, the reduce-scatter) and dtype, at sizes that
  split into the node's chunks and sizes that need padding, over the view of all 4 ranks;
* a view of one member per node (a TP-like pair on two nodes);
* views within one node of the same buffer keep the one-kernel form and the member-order sum;
* one compiled call (aot_eager, fullgraph) over the spanning view;
* a call during CUDA graph capture is refused before it runs, and the view stays usable;
* construction: uneven nodes, a too small buffer and ranks of which only some span nodes are
  refused on every rank;
* a member that aborts the view on the other node: the rest raise PeerAborted naming it,
  long before the budget.
"""

import time

import pytest
import torch
import torch.distributed as dist
from oracles import first_difference

import symmsync as ss
from symmsync import collectives as C

NODE_SIZE = 2
WORLD = 4
MAX_NUMEL = 1032  # a multiple of 4 and 8: the largest reduce-scatter input of 4 members
HIDDEN = 64


# ---------------------------------------------------------------------- the oracle
def nodes_of(view_ranks: list[int]) -> list[list[int]]:
    """The view's members (view indices) by simulated node (world rank w on node w // NODE_SIZE), in node order."""
    by_node: dict[int, list[int]] = {}
    for i, r in enumerate(view_ranks):
        by_node.setdefault(r // NODE_SIZE, []).append(i)
    return [by_node[k] for k in sorted(by_node)]


def node_order_sum(inputs: list[torch.Tensor], nodes: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    partials = []
    for node in nodes:
        acc = inputs[node[0]].to(torch.float32)
        for i in node[1:]:
            acc = acc + inputs[i].to(torch.float32)
        partials.append(acc.to(dtype))
    acc = partials[0].to(torch.float32)
    for p in partials[1:]:
        acc = acc + p.to(torch.float32)
    return acc.to(dtype)


def member_order_sum(inputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = inputs[0].to(torch.float32)
    for x in inputs[1:]:
        acc = acc + x.to(torch.float32)
    return acc.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.numel() == b.numel()
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def wide(shape, dtype, g) -> torch.Tensor:
    """Random values over many orders of magnitude (2^-8 to 2^8): the order of additions shows."""
    scale = torch.exp2(torch.randint(-8, 9, shape, generator=g).to(torch.float32))
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def gathered(x: torch.Tensor, view_ranks: list[int]) -> list[torch.Tensor]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, x)
    return [everyone[r] for r in view_ranks]


# ---------------------------------------------------------------------- set-up on every rank
def _objects(view_ranks: list[int], timeout_s: float = 60.0):
    nodes = len({r // NODE_SIZE for r in view_ranks})
    size = len(view_ranks)
    sizes = {
        op: C.workspace_bytes(MAX_NUMEL, torch.float32, size, op, nodes=nodes)
        for op in ("all_reduce", "all_gather", "reduce_scatter")
    }
    buf = ss.SymmetricBuffer(sum(sizes.values()), backend="host")
    view = buf.view(view_ranks)
    kw = dict(timeout_s=timeout_s)
    ar = C.AllReduce(view, MAX_NUMEL, torch.float32, "auto", offset=0, channel=0, **kw)
    at = sizes["all_reduce"]
    ag = C.AllGather(view, MAX_NUMEL, torch.float32, offset=at, channel=1, **kw)
    rs = C.ReduceScatter(view, MAX_NUMEL, torch.float32, offset=at + sizes["all_gather"], channel=2, **kw)
    return buf, view, {"all_reduce": ar, "all_gather": ag, "reduce_scatter": rs}


def _mine(views: list[list[int]]) -> list[int]:
    rank = dist.get_rank()
    return next(v for v in views if rank in v)


def cases_against_the_oracle(views, cases, seed):
    """Rank function: each case once over this rank's view of ``views``. Returns (the cases whose result
    differs from the node-order oracle, the cases whose flat member-order sum differs from it, the
    results' bytes, the collectives' class names)."""
    view_ranks = _mine(views)
    buf, view, ops = _objects(view_ranks)
    rank, size, nodes = dist.get_rank(), len(view_ranks), nodes_of(view_ranks)
    index = view_ranks.index(rank)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    wrong, order_shows, results = [], [], []
    for case in cases:
        op, dtype, n, how = case
        x = wide((n,), dtype, g)
        if op == "fused":
            x = wide((n // HIDDEN, HIDDEN), dtype, g)
            r = torch.Generator().manual_seed(seed)  # the residual and weight alike on every member
            residual, weight = wide(x.shape, dtype, r), torch.rand(HIDDEN, generator=r).to(dtype) + 0.5
            y, res = ops["all_reduce"](x, residual=residual, norm_weight=weight, eps=1e-6)
            inputs = gathered(x, view_ranks)
            s = node_order_sum(inputs, nodes, dtype)
            want_res = (s.to(torch.float32) + residual.to(torch.float32)).to(dtype)
            h = want_res.to(torch.float32)
            want_y = (h / torch.sqrt(h.square().mean(-1, keepdim=True) + 1e-6) * weight.to(torch.float32)).to(dtype)
            close = torch.allclose(y.to(torch.float32), want_y.to(torch.float32), rtol=1e-2, atol=1e-2)
            if not (same_bits(res, want_res) and close):
                wrong.append(case)
            if not same_bits(member_order_sum(inputs, dtype), s):
                order_shows.append(case)
            results.append((y.view(torch.uint8).tolist(), res.view(torch.uint8).tolist()))
            continue
        target = ops["all_reduce"] if op in ("one_shot", "two_shot") else ops[op]
        if how == "symmetric":
            t = target.input(n, dtype)
            t.copy_(x)
            got = target(t, algorithm=op) if target is ops["all_reduce"] else target(t)
        elif how == "out":
            out = torch.empty(
                n * size if op == "all_gather" else n // size if op == "reduce_scatter" else n, dtype=dtype
            )
            got = target(x, out, algorithm=op) if target is ops["all_reduce"] else target(x, out)
            got = got if got is out else None
        else:
            got = target(x, algorithm=op) if target is ops["all_reduce"] else target(x)
        inputs = gathered(x, view_ranks)
        if op == "all_gather":
            want = torch.cat(inputs)
            flat = want
        else:
            want, flat = node_order_sum(inputs, nodes, dtype), member_order_sum(inputs, dtype)
            if op == "reduce_scatter":
                k = n // size
                want, flat = want[index * k : (index + 1) * k], flat[index * k : (index + 1) * k]
        if got is None or not same_bits(got, want):
            wrong.append(case)
        if not same_bits(flat, want):
            order_shows.append(case)
        results.append(got.view(torch.uint8).tolist() if got is not None else None)
    # The form each object took: over nodes, its node steps over the view's node view.
    names = sorted({type(o).__name__ + (" over nodes" if o.node_view is not None else "") for o in ops.values()})
    buf.close()
    return wrong, order_shows, results, names


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(WORLD, {"SYMMSYNC_NODE_SIZE": str(NODE_SIZE)}, timeout_s=240)


ALL = [[0, 1, 2, 3]]
CASES = [
    ("one_shot", torch.bfloat16, 777, "copy"),  # 777: padded to 2 x 389 for the node reduce-scatter
    ("two_shot", torch.bfloat16, 1024, "symmetric"),
    ("one_shot", torch.bfloat16, 1, "out"),
    ("one_shot", torch.float16, 1000, "out"),
    ("one_shot", torch.float32, 777, "copy"),
    ("fused", torch.bfloat16, 4 * HIDDEN, "copy"),
    ("all_gather", torch.bfloat16, 333, "copy"),
    ("all_gather", torch.float32, 5, "symmetric"),
    ("reduce_scatter", torch.bfloat16, 1028, "copy"),
    ("reduce_scatter", torch.float16, 8, "symmetric"),
]
# The sums whose flat member-order result must differ from the node-order oracle (the oracle
# discriminates): bfloat16 and float16 over hundreds of elements.
ORDER_SHOWS = {c for c in CASES if c[1] is not torch.float32 and c[0] != "all_gather" and c[2] >= 256}


def test_every_operation_over_two_nodes_is_the_node_order_sum_bit_for_bit_on_every_member(pool):
    seed = int(time.time()) % 10_000
    out = pool.call(cases_against_the_oracle, ALL, CASES, seed)
    for rank, (wrong, order_shows, _results, names) in enumerate(out):
        assert wrong == [], f"seed {seed}: rank {rank}: cases that differ from the node-order oracle: {wrong}"
        assert ORDER_SHOWS <= set(order_shows), (
            f"seed {seed}: the flat sum equals the oracle in {ORDER_SHOWS - set(order_shows)}"
        )
        assert names == ["AllGather over nodes", "AllReduce over nodes", "ReduceScatter over nodes"], names
    sums = [i for i, c in enumerate(CASES) if c[0] not in ("all_gather", "reduce_scatter")]
    for i in sums:  # the all-reduce's result: the same bits on every member
        assert len({repr(r[2][i]) for r in out}) == 1, f"seed {seed}: case {CASES[i]} differs between members"


def test_a_view_of_one_member_per_node_sums_across_the_two_nodes(pool):
    seed = int(time.time()) % 10_000
    cases = [
        ("one_shot", torch.bfloat16, 777, "copy"),
        ("all_gather", torch.float16, 100, "copy"),
        ("reduce_scatter", torch.bfloat16, 1024, "copy"),
    ]
    out = pool.call(cases_against_the_oracle, [[0, 2], [1, 3]], cases, seed)
    for rank, (wrong, _order_shows, _results, names) in enumerate(out):
        assert wrong == [], f"seed {seed}: rank {rank}: cases that differ from the node-order oracle: {wrong}"
        assert names == ["AllGather over nodes", "AllReduce over nodes", "ReduceScatter over nodes"], names


def test_views_within_one_node_of_a_two_node_buffer_keep_the_one_kernel_form(pool):
    seed = int(time.time()) % 10_000
    cases = [("one_shot", torch.bfloat16, 777, "copy"), ("reduce_scatter", torch.float16, 1000, "copy")]
    out = pool.call(cases_against_the_oracle, [[0, 1], [2, 3]], cases, seed)
    for rank, (wrong, _order_shows, _results, names) in enumerate(out):
        # One node: node_order_sum of one node is the member-order sum, today's order.
        assert wrong == [], f"seed {seed}: rank {rank}: cases that differ from the member-order oracle: {wrong}"
        assert names == ["AllGather", "AllReduce", "ReduceScatter"], names


# ---------------------------------------------------------------------- torch.compile
def compiled_call(seed):
    """Rank function: one all-reduce over the spanning view inside torch.compile(aot_eager, fullgraph)."""
    buf, view, ops = _objects(ALL[0])
    ar = ops["all_reduce"]
    rank = dist.get_rank()
    x = wide((2, HIDDEN), torch.bfloat16, torch.Generator().manual_seed(seed + rank))
    compiled = torch.compile(lambda t: ar(t * 2.0), backend="aot_eager", fullgraph=True)
    got = compiled(x)
    want = node_order_sum([t * 2.0 for t in gathered(x, ALL[0])], nodes_of(ALL[0]), torch.bfloat16)
    buf.close()
    torch._dynamo.reset()
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        return f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    return first_difference(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_a_compiled_all_reduce_over_two_nodes_gives_the_oracle(pool):
    for rank, diff in enumerate(pool.call(compiled_call, 11)):
        assert diff == (0, []), f"rank {rank}: bytes that differ from the oracle (count, first offsets): {diff}"


# ---------------------------------------------------------------------- CUDA graph capture
def called_while_capturing(seed):
    """Rank function: the all-reduce over the spanning view as if this rank's stream captured a
    CUDA graph (refused, nothing run or aborted), then the same call outside: the oracle."""
    from symmsync import backends

    buf, view, ops = _objects(ALL[0])
    ar = ops["all_reduce"]
    x = wide((2, HIDDEN), torch.bfloat16, torch.Generator().manual_seed(seed + dist.get_rank()))
    real = backends.capturing
    backends.capturing = lambda device: True  # what a capturing CUDA stream reports
    try:
        refused = _error(lambda: ar(x))
    finally:
        backends.capturing = real
    want = node_order_sum(gathered(x, ALL[0]), nodes_of(ALL[0]), torch.bfloat16)
    after = same_bits(ar(x), want)
    buf.close()
    return refused, after


def test_a_call_over_two_nodes_during_cuda_graph_capture_is_refused_and_the_view_stays_usable(pool):
    for rank, (refused, after) in enumerate(pool.call(called_while_capturing, 21)):
        assert refused is not None and refused[0] == "CaptureError", refused
        assert refused[1].startswith(
            f"rank {rank}: AllReduce over a view that spans 2 nodes: called while a CUDA graph was being captured"
        ), refused
        assert after is True


# ---------------------------------------------------------------------- construction
def _error(call):
    try:
        call()
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e)
    return None


def refused_constructions():
    """Rank function: (the error of each refused construction, on this rank)."""
    rank = dist.get_rank()
    per = C.workspace_bytes(MAX_NUMEL, torch.float32, 4, nodes=2)
    buf = ss.SymmetricBuffer(per, backend="host")
    errors = []
    uneven = buf.view([0, 1, 2] if rank < 3 else [3])  # 2 members on node 0, 1 on node 1
    errors.append(_error(lambda: C.AllReduce(uneven, MAX_NUMEL, torch.float32)))
    whole = buf.view([0, 1, 2, 3])
    errors.append(_error(lambda: C.AllReduce(whole, 2 * MAX_NUMEL, torch.float32)))  # too small a buffer
    some = buf.view([0, 2] if rank in (0, 2) else [rank])  # ranks 0 and 2 span nodes, 1 and 3 do not
    errors.append(_error(lambda: C.AllGather(some, 8, torch.float32)))
    buf.close()
    return errors


def test_uneven_nodes_a_small_buffer_and_mixed_forms_are_refused_on_every_rank(pool):
    out = pool.call(refused_constructions)
    for rank, (uneven, small, mixed) in enumerate(out):
        assert uneven is not None and uneven[0] == "ConfigError" and "unevenly" in uneven[1], (rank, uneven)
        assert "2 nodes: [0, 1] [2]" in uneven[1], (rank, uneven)
        assert small is not None and small[0] == "BoundsError" and "nodes=2" in small[1], (rank, small)
        assert mixed is not None and mixed[0] == "ConfigError" and "the node steps differs" in mixed[1], (rank, mixed)


# ---------------------------------------------------------------------- calls that differ
def calls_that_differ_across_nodes():
    """Rank function: node 1 calls the all-reduce with another size, then (on another view) the
    all-gather with another dtype of the same bytes. Returns (error type, differing fields) per call."""
    rank = dist.get_rank()
    per = C.workspace_bytes(1024, torch.float32, WORLD, nodes=2)
    buf = ss.SymmetricBuffer(per + C.workspace_bytes(1024, torch.float32, WORLD, "all_gather", nodes=2), backend="host")
    first, second = buf.view(ALL[0]), buf.view(ALL[0])
    ar = C.AllReduce(first, 1024, torch.float32, timeout_s=60)
    ag = C.AllGather(second, 1024, torch.float32, offset=per, timeout_s=60)
    other = rank >= NODE_SIZE  # node 1
    got = []
    for call in (
        (lambda: ar(torch.ones(514 if other else 512))),
        (lambda: ag(torch.ones(16, dtype=torch.bfloat16) if other else torch.ones(8))),
    ):
        try:
            call()
            got.append(None)
        except ss.SymmSyncError as e:
            got.append((type(e).__name__, getattr(e, "differs", None), "across nodes" in str(e)))
    dist.barrier()
    buf.close()
    return got


def test_calls_that_differ_between_nodes_are_refused_on_every_member(pool):
    # Without the comparison, gloo ends every process on the sizes that differ, and the dtypes of
    # equal bytes sum garbage.
    out = pool.call(calls_that_differ_across_nodes)
    for rank, calls in enumerate(out):
        for got, fields in zip(calls, (["numel"], ["numel", "dtype"])):
            assert got is not None and got[0] in ("CollectiveMismatch", "PeerAborted"), (rank, got)
            if got[0] == "CollectiveMismatch":
                assert got[1] == fields and got[2], (rank, got)
    for i in range(2):  # every position compares the headers; a member may hear of the refusal first
        assert any(calls[i][0] == "CollectiveMismatch" for calls in out), out


# ---------------------------------------------------------------------- failure
ABORT_AFTER_S = 3.0


def abort_on_the_other_node(timeout_s):
    """Rank function: after one good call, the others call again and rank 3 aborts the view
    ``ABORT_AFTER_S`` later, while they wait in their steps: rank 2 in the node step (for rank 3),
    rank 1 between nodes (for rank 3), rank 0 in the node step (for rank 1). Rank 3 keeps its
    buffer open until every rank is done, so that only the abort tells them. Returns what each
    raised and how long its call took."""
    buf, view, ops = _objects(ALL[0], timeout_s=timeout_s)
    ar = ops["all_reduce"]
    rank = dist.get_rank()
    ar(torch.ones(100))
    got, elapsed = None, 0.0
    if rank == 3:
        time.sleep(ABORT_AFTER_S)
        view.abort("rank 3 gives up")
    else:
        start = time.monotonic()
        try:
            ar(torch.ones(100))
        except ss.SymmSyncError as e:
            got = (type(e).__name__, sorted(getattr(e, "aborted", {}) or {}), str(e))
        elapsed = time.monotonic() - start
    dist.barrier()
    buf.close()
    return got, elapsed


def test_a_member_that_aborts_on_the_other_node_reaches_every_member_as_peer_aborted(pool):
    budget = 30.0
    out = pool.call(abort_on_the_other_node, budget)
    for rank, (got, elapsed) in enumerate(out[:3]):
        assert got is not None and got[0] == "PeerAborted", (rank, got)
        assert elapsed < ABORT_AFTER_S + budget / 3, (rank, elapsed, got)
        # Rank 3's node peer (in the node step) and its position peer (between nodes) wait for it
        # and name it; rank 0 waits for those two, and names the one that told it first.
        assert (3 in got[1]) if rank in (1, 2) else bool({1, 2, 3} & set(got[1])), (rank, got)
