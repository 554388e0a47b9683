"""Asking before writing: ``DirectKVWriter.accepts()`` is False exactly when ``write()`` refuses.

Host backend, world 2 (PCP2). For each case (both ranks pass the same arguments), a fresh
buffer, writer and batch: the predicate's answer, then the write's outcome. The oracle is the
write itself: ``accepts()`` must be False exactly where ``write()`` raised ``InputError`` or
the layout's ``BoundsError`` for a bad layer, True where it returned.
"""

import pytest
import torch
from oracles import GUARD_BYTES, Cache

import symmsync as ss
from symmsync import pcp


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(2, timeout_s=240)


WRITER_CASES = [
    "fits",
    "float32 kv_c",
    "rows of another count",
    "not contiguous",
    "layer 5",
    "no batch",
    "grad",
    "kv_c a Parameter, no_grad",
    "kv_c a Parameter, grad mode on",
]
#: The cases a write must take (a Parameter is a tensor): the rest are refused.
TAKEN = ["fits", "kv_c a Parameter, no_grad"]


def ask_then_write(names):
    cache = Cache(4, 1, 8, base=GUARD_BYTES)
    out = []
    for name in names:
        buf = ss.SymmetricBuffer(cache.end + GUARD_BYTES, backend="host")
        writer = pcp.DirectKVWriter(ss.pcp_view(buf), cache.layout, timeout_s=60)
        batch = writer.prepare(torch.arange(4) + 4 * buf.rank)
        kv, pe, ix = (torch.ones(4, n, dtype=torch.bfloat16) for n in (512, 64, 128))
        layer, grad = 0, False
        if name == "float32 kv_c":
            kv = kv.float()
        elif name == "rows of another count":
            kv = torch.ones(3, 512, dtype=torch.bfloat16)
        elif name == "not contiguous":
            kv = torch.ones(512, 4, dtype=torch.bfloat16).t()
        elif name == "layer 5":
            layer = 5
        elif name == "no batch":
            batch = object()
        elif name == "grad":
            kv, grad = kv.requires_grad_(), True
        elif name.startswith("kv_c a Parameter"):
            kv, grad = torch.nn.Parameter(kv), name.endswith("grad mode on")
        with torch.set_grad_enabled(grad):
            said = writer.accepts(layer, kv, pe, ix, batch)
            try:
                writer.write(layer, kv, pe, ix, batch)
                got = "returned"
            except ss.SymmSyncError as e:
                got = type(e).__name__
        buf.close()
        out.append((name, said, got))
    return out


def test_the_writer_accepts_exactly_what_it_does_not_refuse(pool):
    for rank, results in enumerate(pool.call(ask_then_write, WRITER_CASES)):
        for name, said, got in results:
            assert got in ("returned", "InputError", "BoundsError"), (rank, name, got)
            assert said == (got == "returned"), (rank, name, said, got)
        assert [n for n, said, _ in results if said] == TAKEN, results


def parameter_write(compiled: bool) -> bool:
    """``write()`` with its three inputs ``nn.Parameter`` s, under ``no_grad``, eagerly or compiled
    (``fullgraph=True``, aot_eager), and with plain tensors eagerly into a second buffer: whether
    every replica's bytes are the same (the plain write's own oracle: tests/pcp/test_pcp_formats.py)."""
    torch._dynamo.reset()
    cache = Cache(4, 1, 8, base=GUARD_BYTES)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(4, n, generator=g).to(torch.bfloat16) for n in (512, 64, 128)]
    replicas = []
    for as_parameters in (True, False):
        buf = ss.SymmetricBuffer(cache.end + GUARD_BYTES, backend="host")
        writer = pcp.DirectKVWriter(ss.pcp_view(buf), cache.layout, timeout_s=60)
        batch = writer.prepare(torch.arange(4) + 4 * buf.rank)
        mine = [torch.nn.Parameter(r + buf.rank) if as_parameters else r + buf.rank for r in rows]

        def write(kv_c, k_pe, indexer_k, writer=writer, batch=batch):
            writer.write(0, kv_c, k_pe, indexer_k, batch)

        call = torch.compile(write, fullgraph=True, backend="aot_eager") if compiled and as_parameters else write
        with torch.no_grad():
            call(*mine)
        writer.fence.fence()  # every member's rows are in every replica
        replicas.append(buf.local_memory().clone())
        buf.close()
    return torch.equal(replicas[0], replicas[1])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_write_takes_parameters(pool, compiled):
    assert pool.call(parameter_write, compiled) == [True, True]
