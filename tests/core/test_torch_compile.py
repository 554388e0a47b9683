"""torch.compile keeps write -> fence -> read order (a fence is a compiler boundary).

Functionalization turns writes into graph inputs into copies applied at the end of
the graph; if the fence lived inside the graph, peers would read before the payload
reached memory. Each rank writes into its peer through a view, fences, and reads
what the peer wrote, inside one compiled function, with one rank delayed.
"""

import time

import torch

import symmsync as ss
from symmsync.testing import run


def compiled_exchange(n, with_fence):
    buf = ss.SymmetricBuffer(4096, backend="host")
    r = buf.rank
    fence = ss.Fence(buf.view([0, 1]), timeout_s=60)
    peer = buf.tensor(0, (2, 4), torch.float32, rank=1 - r)
    mine = buf.tensor(0, (2, 4), torch.float32)

    def step(x, parity: int):
        peer[parity].copy_(x * 2.0)
        if with_fence:
            fence.fence()
        return mine[parity] + 1.0

    compiled = torch.compile(step, backend="aot_eager")
    wrong = 0
    for i in range(1, n + 1):
        if r == 1 and i % 3 == 0:
            time.sleep(0.05)
        y = compiled(torch.full((4,), float(100 * r + i)), i % 2)
        wrong += int(not torch.equal(y, torch.full((4,), 2.0 * (100 * (1 - r) + i) + 1.0)))
        if not with_fence:
            torch.distributed.barrier()  # keep the ranks within one step of each other
    buf.close()
    return wrong


def test_compiled_write_fence_read_sees_the_peers_data():
    assert run(compiled_exchange, 2, 12, True, timeout_s=300) == [0, 0]


def test_the_compiled_oracle_bites_without_the_fence():
    assert sum(run(compiled_exchange, 2, 12, False, timeout_s=300)) > 0


def test_the_compiled_path_goes_through_a_compiler_boundary():
    from symmsync import fence

    assert getattr(fence._compiler_boundary, "_torchdynamo_disable", False)


def compiled_mutation_of_buffer_views(kind):
    """A compiled function mutates ``buf.tensor`` views it takes as inputs (functionalized:
    the mutation is copied back into the input's storage); returns what each view holds."""
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


def test_a_compiled_function_that_mutates_buffer_views_touches_only_the_user_region():
    # Functionalization reads and writes its inputs' whole storages: a storage that spanned a
    # guard (address space that is never mapped) would make it fault.
    want = [2.0 + i for i in range(8)]
    for kind in ("allocated", "growable"):
        for total, mine, seen, storage in run(compiled_mutation_of_buffer_views, 2, kind, timeout_s=300):
            assert mine == want and total == sum(want), (kind, mine, total)
            assert seen == [w + 1.0 for w in want], (kind, seen)
            assert storage == 4096, (kind, storage)  # the mapped user bytes: no guard, nothing uncommitted
