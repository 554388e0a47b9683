"""torch.compile keeps write -> fence -> read order, or refuses the graph.

A fence in compiled code is the op ``symmsync::fence`` (fullgraph compiles). Functionalization
turns writes into graph inputs into copies applied at the end of the graph, after the fence,
so peers would read before the payload reached memory: a graph that writes into symmetric
memory and then fences is refused at trace time. Each rank writes into its peer through a
view, fences, and reads what the peer wrote, with one rank delayed: with the write made
before the compiled fence-and-read, every read sees the peer's data; without a fence the
same oracle sees stale data, and so does the refused graph when the refusal is removed
(in this file only, for the call that removes it).
"""

import time

import pytest
import torch

import symmsync as ss


def compiled_exchange(n, mode):
    """``mode``: ``"fence"`` (write, fence and read in one compiled graph), ``"eager write"``
    (the write before the compiled fence and read), ``"no fence"`` (write and read
    compiled, no fence) or ``"unrefused"`` (as ``"fence"``, the trace-time check removed in
    this call, put back at its end). Returns how many steps read stale data, or the error."""
    torch._dynamo.reset()  # as in a fresh process: these ranks serve other tests too (tests/conftest.py)
    shipped = ss.Fence.orders
    if mode == "unrefused":  # the unsafe form: the fence op gets no user region (a tensor of no buffer's), so its
        ss.Fence.orders = lambda self: [torch.empty(0, dtype=torch.uint8)]  # fake finds no write before it
    try:
        return _exchange(n, mode)
    finally:
        ss.Fence.orders = shipped


def _exchange(n, mode):
    buf = ss.SymmetricBuffer(4096, backend="host")
    r = buf.rank
    fence = ss.Fence(buf.view([0, 1]), timeout_s=60)
    peer = buf.tensor(0, (2, 4), torch.float32, rank=1 - r)
    mine = buf.tensor(0, (2, 4), torch.float32)

    def step(x, parity: int):
        if mode != "eager write":
            peer[parity].copy_(x * 2.0)
        if mode != "no fence":
            fence.fence()
        return mine[parity] + 1.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=mode != "no fence")
    wrong = 0
    try:
        for i in range(1, n + 1):
            if r == 1 and i % 3 == 0:
                time.sleep(0.05)
            x = torch.full((4,), float(100 * r + i))
            if mode == "eager write":
                peer[i % 2].copy_(x * 2.0)
            y = compiled(x, i % 2)
            wrong += int(not torch.equal(y, torch.full((4,), 2.0 * (100 * (1 - r) + i) + 1.0)))
            if mode == "no fence":
                torch.distributed.barrier()  # keep the ranks within one step of each other
    except Exception as e:  # noqa: BLE001 - Dynamo wraps what a fake raises; the cause is symmsync's
        cause = e
        while cause is not None and not isinstance(cause, ss.ConfigError):
            cause = cause.__cause__ or cause.__context__
        wrong = f"{type(cause).__name__}: {cause}" if cause is not None else repr(e)
    buf.close()
    return wrong


def test_compiled_fence_then_read_sees_the_peers_data(host_ranks):
    assert host_ranks(compiled_exchange, 2, 12, "eager write", timeout_s=300) == [0, 0]


def test_the_compiled_oracle_bites_without_the_fence(host_ranks):
    assert sum(host_ranks(compiled_exchange, 2, 12, "no fence", timeout_s=300)) > 0


def refused_then_unrefused(n):
    """Rank function: :func:`compiled_exchange` ``"fence"``, then ``"unrefused"`` (one process)."""
    return compiled_exchange(n, "fence"), compiled_exchange(n, "unrefused")


def test_a_graph_that_writes_symmetric_memory_then_fences_is_refused_at_trace_time(host_ranks):
    # Compiled with the fence in the graph, the write lands after it: every rank refuses the
    # graph before running any of it, and the same graph unrefused reads stale data.
    results = host_ranks(refused_then_unrefused, 2, 12, timeout_s=300)
    for error, _ in results:
        assert isinstance(error, str) and error.startswith("ConfigError: a compiled fence follows writes"), error
    stale = [count for _, count in results]  # 8 and 4 of 12 steps when measured
    assert all(isinstance(count, int) for count in stale) and sum(stale) > 0, stale  # the oracle bites


def fenced_counts(kind):
    """Compile ``fence()``, ``arrive(); wait()`` or both fullgraph; the epochs they leave."""
    torch._dynamo.reset()
    buf = ss.SymmetricBuffer(4096, backend="host")
    fence = ss.Fence(buf.view([0, 1]), timeout_s=60)
    mine = buf.tensor(0, (4,), torch.float32)

    def step(x):
        if kind == "fence":
            fence.fence()
        else:
            fence.arrive()
            fence.wait()
        return mine.sum() + x

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        compiled(torch.ones(()))
    epoch = fence.epoch
    buf.close()
    return epoch


@pytest.mark.parametrize("kind", ["fence", "split"])
def test_a_compiled_fence_is_one_op_in_a_fullgraph_and_runs_every_call(host_ranks, kind):
    assert host_ranks(fenced_counts, 2, kind, timeout_s=300) == [3, 3]


def compiled_mutation_of_buffer_views(kind):
    """A compiled function mutates ``buf.tensor`` views it takes as inputs (functionalized:
    the mutation is copied back into the input's storage); returns what each view holds."""
    torch._dynamo.reset()
    if kind == "allocated":
        buf = ss.SymmetricBuffer(4096, backend="host")
    else:  # growable: most of its reservation is not committed yet
        buf = ss.SymmetricBuffer(4096, backend="host", max_nbytes=1 << 20)
    mine = buf.tensor(0, (8,), torch.float32)
    peer = buf.tensor(64, (8,), torch.float32, rank=1 - buf.rank)

    def step(a, b, x):
        a.mul_(2.0).add_(x)
        b.copy_(a + 1.0)
        return a.sum()

    compiled = torch.compile(step, backend="aot_eager")
    mine.fill_(1.0)
    total = float(compiled(mine, peer, torch.arange(8, dtype=torch.float32)))
    torch.distributed.barrier()
    seen = buf.tensor(64, (8,), torch.float32).tolist()  # what the peer's compiled call wrote here
    storage = mine.untyped_storage().nbytes()
    buf.close()
    return total, mine.tolist(), seen, storage


def test_a_compiled_function_that_mutates_buffer_views_touches_only_the_user_region(host_ranks):
    # Functionalization reads and writes its inputs' whole storages: a storage that spanned a
    # guard (address space that is never mapped) would make it fault.
    want = [2.0 + i for i in range(8)]
    for kind in ("allocated", "growable"):
        for total, mine, seen, storage in host_ranks(compiled_mutation_of_buffer_views, 2, kind, timeout_s=300):
            assert mine == want and total == sum(want), (kind, mine, total)
            assert seen == [w + 1.0 for w in want], (kind, seen)
            assert storage == 4096, (kind, storage)  # the mapped user bytes: no guard, nothing uncommitted
