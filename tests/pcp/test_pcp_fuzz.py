"""The direct-KV writer's and the PCP helpers' entry points fed bad input by hypothesis, on the
host backend: only symmsync's own errors come out, on every rank for collective calls, with no
hang and no byte written outside what the call may write (tests/fuzzing.py).
"""

import os

import pytest
import torch
import torch.distributed as dist
from fuzzing import CALL_S, FUZZ, GUARD, JUNK, _assert_own_errors, _outcome, _per_rank
from hypothesis import event, given, settings
from hypothesis import strategies as st

import symmsync as ss
from symmsync import pcp

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm view of POSIX shm")


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(2, timeout_s=120)


# pcp_split, PCPSplit, CacheLayout, IndexerKLayout: pure functions, fuzzed in this process
SMALL_INT = st.one_of(st.integers(-2, 300), st.sampled_from(JUNK))


@settings(FUZZ, max_examples=150)
@given(
    tokens=SMALL_INT,
    p=st.one_of(st.integers(-1, 9), st.sampled_from(JUNK)),
    rank=st.one_of(st.integers(-1, 9), st.sampled_from(JUNK)),
    rows=st.one_of(st.integers(0, 301), st.sampled_from(JUNK)),
)
def test_fuzz_pcp_split(tokens, p, rank, rows):
    out = _outcome(lambda: pcp.pcp_split(tokens, p))
    _assert_own_errors([out], collective=False, names_rank=False)
    ok_int = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    assert (out[0] == "ok") == (ok_int and isinstance(p, int) and not isinstance(p, bool) and 0 < p <= 1 << 16), out
    if out[0] != "ok":
        return
    split = out[1]
    sized = isinstance(rows, int) and not isinstance(rows, bool) and 0 <= rows <= 301
    x = torch.zeros(rows, 3) if sized else rows
    slots = torch.arange(rows) if sized else rows
    for call in (
        lambda: split.local_rows(x, rank),
        lambda: split.local_slots(slots, rank),
        lambda: split.gathered_slots(slots),
    ):
        _assert_own_errors([_outcome(call)], collective=False, names_rank=False)


@settings(FUZZ, max_examples=150)
@given(
    blocks=SMALL_INT,
    layers=st.one_of(st.integers(-1, 4), st.sampled_from(JUNK)),
    block_size=st.one_of(st.integers(-1, 130), st.sampled_from(JUNK)),
    base=st.one_of(st.integers(-128, 1024), st.sampled_from(JUNK)),
    layer=st.one_of(st.integers(-1, 5), st.sampled_from(JUNK)),
    slot=st.integers(0, 10**6),
)
def test_fuzz_cache_layout(blocks, layers, block_size, base, layer, slot):
    def pos(v):
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    out = _outcome(lambda: pcp.CacheLayout(blocks, layers, block_size, base))
    _assert_own_errors([out], collective=False, names_rank=False)
    base_ok = isinstance(base, int) and not isinstance(base, bool) and base >= 0 and base % 128 == 0
    assert (out[0] == "ok") == (pos(blocks) and pos(layers) and pos(block_size) and base_ok), out
    ix = _outcome(lambda: pcp.IndexerKLayout(block_size))
    _assert_own_errors([ix], collective=False, names_rank=False)
    assert (ix[0] == "ok") == pos(block_size)
    if ix[0] == "ok":
        assert ix[1].value_offset(slot) + 128 <= ix[1].scale_offset(slot - slot % block_size)
    if out[0] == "ok":
        lay = out[1]
        got = _outcome(lambda: (lay.main_offset(layer), lay.indexer_offset(layer)))
        _assert_own_errors([got], collective=False, names_rank=False)
        layer_ok = isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < layers
        assert (got[0] == "ok") == layer_ok
        if layer_ok:  # a layer's regions lie inside [base, end) and do not overlap the next layer
            main, idx = got[1]
            assert base <= main < idx < idx + lay.indexer_bytes <= lay.end
            assert idx + lay.indexer_bytes == base + (layer + 1) * lay.layer_bytes


# DirectKVWriter(view, layout, ...), prepare(slot_mapping), write(layer, kv_c, k_pe, indexer_k, batch)
WRITER_ARGS = st.fixed_dictionaries(
    {
        "layout": st.sampled_from(["main", "main", "main", "bigger", "too_big", None, "layout"]),
        "route": st.sampled_from(["direct", "direct", "allgather", "nccl", None]),
        "fused": st.booleans(),
        "channel": st.one_of(st.integers(-1, 2), st.sampled_from([None, "0", 0.0])),
        "timeout_s": st.sampled_from([None, 30, 0, -1, float("inf"), "30"]),
        "block_rows": st.one_of(st.sampled_from([1, 16, 1024]), st.sampled_from([0, 3, 2048, 16.0, None, True])),
        "num_warps": st.sampled_from([4, 4, 1, 32, 0, 3, 64, None]),
        "programs_per_sm": st.sampled_from([4, 4, 0, -1, None]),
        "debug": st.booleans(),
    }
)
VALID_WRITER_ARGS = st.fixed_dictionaries(
    {
        "layout": st.just("main"),
        "route": st.sampled_from(["direct", "direct", "allgather"]),
        "fused": st.booleans(),  # fused with allgather is rejected
        "channel": st.sampled_from([0, 1]),
        "timeout_s": st.sampled_from([None, 30]),
        "block_rows": st.sampled_from([1, 16, 1024]),
        "num_warps": st.sampled_from([1, 4, 32]),
        "programs_per_sm": st.sampled_from([1, 4]),
        "debug": st.booleans(),
    }
)
PREPARE = st.one_of(st.just("ok"), st.sampled_from(["range", "below", "float", "2d", "length", "list", "same_slots"]))
WRITE = st.sampled_from(
    [
        "ok",
        "ok",
        "layer_out",
        "layer_junk",
        "dtype",
        "shape",
        "rows",
        "noncontiguous",
        "meta",
        "foreign_batch",
        "handmade_batch",
        "slots_as_batch",
    ]
)
ROWS = 8


def _layouts():
    main = pcp.CacheLayout(num_blocks=1, num_layers=2, base=128)  # 64 slots per layer
    bigger = pcp.CacheLayout(num_blocks=2, num_layers=1, base=128)  # 128 slots, fits the same buffer
    # A second writer's caches, bytes of their own (writers of other layouts may not share bytes).
    spare = pcp.CacheLayout(num_blocks=2, num_layers=1, base=ss.carve(start=main.end + 256, caches=0)["caches"])
    return main, bigger, spare


def fuzz_writer(ctor, prep, write, layer):
    r = dist.get_rank()
    main, bigger, spare = _layouts()
    nbytes = main.end + 256  # what the guard bytes cover: the spare writer's caches lie past them
    buf = ss.SymmetricBuffer(spare.end, backend="host", channels=2)
    try:
        view = buf.view([0, 1])
        mem = buf.tensor(0, (nbytes,), torch.uint8)
        mem.fill_(GUARD)
        for lay in range(main.num_layers):
            main.layer_backing(buf, lay).zero_()
        dist.barrier()
        c = ctor[r]
        named = {"main": main, "bigger": bigger, "too_big": pcp.CacheLayout(num_blocks=50)}
        lay_arg = named.get(c["layout"], c["layout"])
        kwargs = {k: c[k] for k in ("route", "fused", "channel", "timeout_s", "block_rows", "num_warps", "debug")}
        made = _outcome(lambda: pcp.DirectKVWriter(view, lay_arg, programs_per_sm=c["programs_per_sm"], **kwargs))
        out = {"made": made if made[0] != "ok" else ("ok",)}
        if not _all_ok(made):
            return out
        writer = made[1]
        slots = torch.arange(ROWS) + ROWS * r
        mapping = {
            "ok": slots,
            "range": slots + 1000,
            "below": slots - 100,
            "float": slots.float(),
            "2d": slots.view(2, -1),
            "length": torch.arange(ROWS + 1) + ROWS * r,
            "list": slots.tolist(),
            "same_slots": torch.arange(ROWS),  # both ranks claim the same slots (caught with debug)
        }[prep[r]]
        prepared = _outcome(lambda: writer.prepare(mapping))
        out["prepare"] = prepared if prepared[0] != "ok" else ("ok",)
        if not _all_ok(prepared):
            return out
        batch = prepared[1]
        free = 1 - writer.fence.channel if writer.fence else 0
        other = pcp.DirectKVWriter(view, spare, route=writer.route, channel=free)  # a second writer
        g = torch.Generator().manual_seed(r)
        kv, pe, ix = (torch.randn(ROWS, w, generator=g).to(torch.bfloat16) for w in (512, 64, 128))
        args = {
            "ok": (layer, kv, pe, ix, batch),
            "layer_out": (main.num_layers, kv, pe, ix, batch),
            "layer_junk": (str(layer), kv, pe, ix, batch),
            "dtype": (layer, kv.float(), pe, ix, batch),
            "shape": (layer, kv[:, :256].contiguous(), pe, ix, batch),
            "rows": (layer, kv[:4].contiguous(), pe[:4].contiguous(), ix[:4].contiguous(), batch),
            "noncontiguous": (layer, kv.t().contiguous().t(), pe, ix, batch),
            "meta": (layer, kv.to("meta"), pe, ix, batch),
            "foreign_batch": (layer, kv, pe, ix, other.prepare(torch.arange(ROWS) + 100 + ROWS * r)),
            "handmade_batch": (layer, kv, pe, ix, pcp.Batch(slots=torch.arange(ROWS) + 1000, rows=ROWS)),
            "slots_as_batch": (layer, kv, pe, ix, slots),
        }[write]
        before = mem.clone()
        dist.barrier()
        wrote = _outcome(lambda: writer.write(*args))
        dist.barrier()
        out["write"] = wrote if wrote[0] != "ok" else ("ok",)
        # What may change: nothing after a rejected write; the layer's backing after an accepted one.
        expect = before.clone()
        if wrote[0] == "ok":
            start = main.main_offset(layer)
            expect[start : start + main.layer_bytes] = mem[start : start + main.layer_bytes]
        out["untouched"] = bool(torch.equal(mem, expect))
        return out
    finally:
        buf.close()


def _all_ok(outcome):
    oks = [None, None]
    dist.all_gather_object(oks, outcome[0] == "ok")
    return all(oks)


@settings(FUZZ, max_examples=30)
@given(
    ctor=_per_rank(st.one_of(VALID_WRITER_ARGS, VALID_WRITER_ARGS, WRITER_ARGS)),
    prep=_per_rank(PREPARE),
    write=WRITE,
    layer=st.integers(0, 1),
)
def test_fuzz_direct_kv_writer(pool, ctor, prep, write, layer):
    results = pool.call(fuzz_writer, ctor, prep, write, layer, timeout_s=CALL_S)
    event(f"reached: {', '.join(k for k in ('made', 'prepare', 'write') if k in results[0])}")
    event(f"write accepted: {'write' in results[0] and results[0]['write'][0] == 'ok'}")
    for step in ("made", "prepare"):
        got = [r[step] for r in results if step in r]
        if got:
            _assert_own_errors(got, collective=True)
    writes = [r["write"] for r in results if "write" in r]
    if writes:
        _assert_own_errors(writes, collective=False)
        assert all(r["untouched"] for r in results), f"a write changed bytes outside its layer: {results}"
        if write not in ("ok",):
            assert all(w[0] == "raised" for w in writes), writes
