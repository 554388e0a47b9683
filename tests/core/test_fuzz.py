"""Every public entry point fed bad input by hypothesis, on the host backend.

Only symmsync's own exceptions come out, on every rank for collective calls, with no
hang and no byte written outside what the call may write. Ranks stay alive across
examples (:class:`symmsync.testing.RankPool`).
"""

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import symmsync as ss
from symmsync import pcp
from symmsync.testing import RankPool

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm view of POSIX shm")


# ---------------------------------------------------------------------- bad input, fuzzed
# Every public entry point is fed values hypothesis draws, junk included. Ranks stay alive
# across examples (RankPool); each call reports, per rank, what happened:
#   ("ok", ...)                                the call was accepted
#   ("raised", exception type, message)        a SymmSyncError
#   ("foreign", exception type, traceback)     anything else: never allowed
# Collective calls must be accepted on every rank or raise on every rank; a call that
# leaves one rank waiting shows up as a pool call that does not finish (a hang).
GUARD = 0x5A
JUNK = [None, 1.5, float("inf"), float("nan"), "16", b"x", [], {}, object(), True, -(2**70), 2**70]
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CALL_S = 60  # per pool call: a collective that leaves a rank waiting fails here


def _outcome(call):
    import traceback

    try:
        value = call()
    except ss.SymmSyncError as e:
        return ("raised", type(e).__name__, str(e))
    except Exception as e:  # noqa: BLE001 - the one thing these tests must never see
        return ("foreign", type(e).__name__, traceback.format_exc())
    return ("ok", value)


def _assert_own_errors(outcomes, collective, valid=None, names_rank=True):
    kinds = [o[0] for o in outcomes]
    assert "foreign" not in kinds, "\n".join(o[2] for o in outcomes if o[0] == "foreign")
    if collective:
        assert len(set(kinds)) == 1, f"some ranks raised, some did not: {outcomes}"
    if valid is not None:
        want = "ok" if valid else "raised"
        assert all(k == want for k in kinds), f"expected {want} on every rank: {outcomes}"
    for o in outcomes:
        if o[0] == "raised" and names_rank:
            assert "rank" in o[2], o


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout_s=120) as p:
        yield p


def _per_rank(strategy):
    """The same value for both ranks, or one for each (mismatches across ranks)."""
    return st.one_of(strategy.map(lambda v: [v, v]), st.lists(strategy, min_size=2, max_size=2))


# SymmetricBuffer(nbytes, backend, max_views, channels, backend_options, device)
def _int_or_junk(lo, hi):
    return st.one_of(st.integers(lo, hi), st.sampled_from(JUNK))


BUFFER_ARGS = st.fixed_dictionaries(
    {
        "nbytes": st.one_of(st.integers(-16, 1 << 16), st.sampled_from(JUNK + [2**62, 2**64])),
        "backend": st.sampled_from(["host", "auto", "cuda", "nvshmem", None, 3, ["host"]]),
        "max_views": _int_or_junk(-1, 64),
        "channels": _int_or_junk(-1, 64),
        "backend_options": st.sampled_from([None, {}, {"handle_type": 1}, {1: 2}, [1], "x"]),
        "device": st.sampled_from([None, "cpu", "bogus", "cuda:99", 1.5]),
    }
)


def _valid_buffer_args(per_rank):
    def ok_int(v, hi):
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= hi

    for a in per_rank:
        if not (ok_int(a["nbytes"], 1 << 16) and ok_int(a["max_views"], 64) and ok_int(a["channels"], 64)):
            return False
        if a["backend"] not in ("host", "auto") or a["device"] not in (None, "cpu"):
            return False
        if a["backend_options"] not in (None, {}):
            return False
    return all(per_rank[0][k] == per_rank[1][k] for k in ("nbytes", "max_views", "channels"))


def fuzz_buffer(per_rank):
    a = per_rank[dist.get_rank()]

    def build():
        buf = ss.SymmetricBuffer(
            a["nbytes"],
            device=a["device"],
            backend=a["backend"],
            max_views=a["max_views"],
            channels=a["channels"],
            backend_options=a["backend_options"],
        )
        nbytes = buf.nbytes
        buf.close()
        return nbytes

    return _outcome(build)


@FUZZ
@given(per_rank=_per_rank(BUFFER_ARGS))
def test_fuzz_symmetric_buffer_arguments(pool, per_rank):
    outcomes = pool.call(fuzz_buffer, per_rank, timeout_s=CALL_S)
    _assert_own_errors(outcomes, collective=True, valid=_valid_buffer_args(per_rank))


# buffer.tensor(offset, shape, dtype, rank) and PeerView.tensor(..., index)
DTYPES = sorted({getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}, key=str)
TENSOR_ARGS = st.fixed_dictionaries(
    {
        "offset": st.one_of(st.integers(-32, 1100), st.integers(0, 64).map(lambda k: 16 * k), st.sampled_from(JUNK)),
        "shape": st.one_of(
            st.lists(st.integers(-2, 70), max_size=3),
            st.integers(-2, 300),
            st.sampled_from([None, 1.5, "ab", [1.5], [None], (2**70,)]),
        ),
        "dtype": st.one_of(st.sampled_from(DTYPES), st.sampled_from(["float32", None, torch.Tensor, 4])),
        "rank": st.one_of(st.none(), st.integers(-1, 3), st.sampled_from(JUNK)),
        "via_view": st.booleans(),
    }
)
NBYTES_SMALL = 1024


def _valid_tensor_args(a, world=2):
    def is_int(v):
        return isinstance(v, int)  # the library takes bools as ints here, like Python does

    shape = (a["shape"],) if is_int(a["shape"]) else a["shape"]
    if not isinstance(shape, (list, tuple)) or not all(is_int(s) and s >= 0 for s in shape):
        return False
    if not isinstance(a["dtype"], torch.dtype) or not is_int(a["offset"]) or a["offset"] < 0 or a["offset"] % 16:
        return False
    if a["rank"] is not None and not (is_int(a["rank"]) and 0 <= a["rank"] < world):
        return False
    size = a["dtype"].itemsize
    for s in shape:
        size *= s
    return a["offset"] + size <= NBYTES_SMALL


def fuzz_tensor(a):
    buf = ss.SymmetricBuffer(NBYTES_SMALL, backend="host")
    view = buf.view([0, 1])
    try:
        mem = buf.local_memory()
        mem.fill_(GUARD)
        before = mem.clone()
        dist.barrier()
        if a["via_view"]:
            out = _outcome(lambda: view.tensor(a["offset"], a["shape"], a["dtype"], a["rank"]))
        else:
            out = _outcome(lambda: buf.tensor(a["offset"], a["shape"], a["dtype"], a["rank"]))
        span = None
        if out[0] == "ok":
            t = out[1]
            target = buf.rank if a["rank"] is None else a["rank"]
            start = t.data_ptr() - int(buf.ptrs[target])
            span = (target, start, start + t.numel() * t.element_size())
            if t.numel():
                t.view(-1).view(torch.uint8).fill_(0xC3)  # write through the view
            out = ("ok", span)
        spans = [None, None]
        dist.all_gather_object(spans, span)
        dist.barrier()
        # The only bytes that changed in this rank's whole allocation are those of views of it.
        expect = before.clone()
        for s in spans:
            if s is not None and s[0] == buf.rank:
                expect[s[1] : s[2]] = 0xC3
        untouched = bool(torch.equal(mem, expect))
        dist.barrier()
        return out, untouched
    finally:
        buf.close()


@settings(FUZZ, max_examples=40)
@given(a=TENSOR_ARGS)
def test_fuzz_tensor_views_of_the_buffer(pool, a):
    results = pool.call(fuzz_tensor, a, timeout_s=CALL_S)
    outcomes = [r[0] for r in results]
    valid = _valid_tensor_args(a)
    if a["via_view"] and a["rank"] is not None and not isinstance(a["rank"], int):
        valid = False
    _assert_own_errors(outcomes, collective=False, valid=valid)
    for o in outcomes:
        if o[0] == "ok":
            target, start, end = o[1]
            assert 0 <= start <= end <= NBYTES_SMALL, o
            assert start == a["offset"] or start == end, o
    assert all(r[1] for r in results), "a byte outside the returned views changed"


# buffer.view(ranks), pcp_view / tp_view(tp), tp_pcp_ranks(rank, tp, pcp)
RANK_ITEM = st.one_of(st.integers(-1, 3), st.sampled_from([1.0, 1.5, "1", None, float("inf"), float("nan"), True]))
VIEW_RANKS = st.one_of(st.lists(RANK_ITEM, max_size=3), st.sampled_from([None, "01", 5, b"\x00\x01", [[0, 1]]]))


def _parse_ranks(req, me, world=2):
    """What a rank list asks for, or None if it is not a valid view for rank ``me``."""
    if not isinstance(req, (list, tuple)):
        return None
    out = []
    for r in req:
        if isinstance(r, (bool, str, bytes)) or not isinstance(r, (int, float)) or r != r or r in (float("inf"),):
            return None
        if int(r) != r:
            return None
        out.append(int(r))
    if not out or len(set(out)) != len(out) or any(not 0 <= r < world for r in out) or me not in out:
        return None
    return tuple(out)


def _valid_views(per_rank):
    reqs = [_parse_ranks(per_rank[r], r) for r in range(2)]
    return all(q is not None for q in reqs) and all(reqs[m] == q for q in reqs for m in q)


def fuzz_view(per_rank, tp_per_rank):
    buf = ss.SymmetricBuffer(NBYTES_SMALL, backend="host")
    try:
        r = buf.rank
        made = _outcome(lambda: list(buf.view(per_rank[r]).ranks))
        layout = _outcome(lambda: (list(ss.pcp_view(buf, tp_per_rank[r]).ranks), list(ss.tp_view(buf, 1).ranks)))
        pure = _outcome(lambda: ss.tp_pcp_ranks(r, tp_per_rank[r], 2))
        return made, layout, pure
    finally:
        buf.close()


TP = st.one_of(st.integers(-1, 3), st.sampled_from([None, 1.0, "2", True]))


@settings(FUZZ, max_examples=40)
@given(per_rank=_per_rank(VIEW_RANKS), tp=_per_rank(TP))
def test_fuzz_peer_views(pool, per_rank, tp):
    results = pool.call(fuzz_view, per_rank, tp, timeout_s=CALL_S)
    made = [r[0] for r in results]
    _assert_own_errors(made, collective=True, valid=_valid_views(per_rank))
    for rank, o in enumerate(made):
        if o[0] == "ok":
            assert o[1] == [int(x) for x in per_rank[rank]]
    tp_ok = [isinstance(t, int) and not isinstance(t, bool) and t in (1, 2) for t in tp]
    layout = [r[1] for r in results]
    _assert_own_errors(layout, collective=True, valid=all(tp_ok))
    pure = [r[2] for r in results]
    _assert_own_errors(pure, collective=False, names_rank=False)
    for rank, o in enumerate(pure):  # tp_pcp_ranks(rank, tp, pcp=2): any positive int tp holds ranks 0 and 1
        t = tp[rank]
        assert (o[0] == "ok") == (isinstance(t, int) and not isinstance(t, bool) and t >= 1), (tp, o)


# Fence(view, channel, timeout_s): one fence with what was accepted
FENCE_ARGS = st.fixed_dictionaries(
    {
        "channel": st.one_of(st.integers(-1, 4), st.sampled_from(JUNK)),
        "timeout_s": st.one_of(
            st.none(),
            st.floats(allow_nan=True, allow_infinity=True),
            st.sampled_from([0, -1, 1e9, 1e9 + 1, 1e10, 2.0, True, "5", 10**30]),
        ),
    }
)


def fuzz_fence(a):
    buf = ss.SymmetricBuffer(NBYTES_SMALL, backend="host", channels=4)
    try:
        view = buf.view([0, 1])
        made = _outcome(lambda: ss.Fence(view, a["channel"], timeout_s=a["timeout_s"]))
        ok = [None, None]
        dist.all_gather_object(ok, made[0] == "ok")
        if made[0] != "ok":
            return made
        fence = made[1]
        if all(ok) and fence.timeout_s >= 1.0:  # a budget a peer can meet: the fence must pass
            fence.fence()
            return ("ok", (fence.timeout_s, fence.epoch))
        return ("ok", (fence.timeout_s, None))
    finally:
        buf.close()


@settings(FUZZ, max_examples=30)
@given(a=FENCE_ARGS)
def test_fuzz_fence_arguments(pool, a):
    outcomes = pool.call(fuzz_fence, a, timeout_s=CALL_S)
    c, t = a["channel"], a["timeout_s"]
    valid = isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 4
    valid = valid and (t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 1e9))
    _assert_own_errors(outcomes, collective=True, valid=valid)
    for o in outcomes:
        if o[0] == "ok" and o[1][1] is not None:
            assert o[1][1] == 1  # the one fence ran


# SymmetricBuffer.from_peer_addresses(ptrs, nbytes, device, max_views, channels)
ADOPT_ARGS = st.fixed_dictionaries(
    {
        "ptrs": st.sampled_from(
            ["real", "short", "long", "float", "str", "none", "zero", "negative", "huge", "not_a_list", "tensor"]
        ),
        "nbytes": st.one_of(st.integers(-1, 1 << 14), st.sampled_from(["all", 1.5, None, "4096"])),
        "device": st.sampled_from([None, "cpu", "bogus"]),
        "max_views": _int_or_junk(0, 4),
        "cells": st.sampled_from(["separate", "tail", "middle"]),
    }
)


def fuzz_adopt(per_rank):
    a = per_rank[dist.get_rank()]
    own = ss.SymmetricBuffer(1 << 14, backend="host")
    try:
        real = own.ptrs.tolist()
        ptrs = {
            "real": real,
            "short": real[:1],
            "long": real + real[:1],
            "float": [float(p) for p in real],
            "str": [str(p) for p in real],
            "none": [None] * len(real),
            "zero": [0] + real[1:],
            "negative": [-p for p in real],
            "huge": [p + 2**64 for p in real],
            "not_a_list": 12345,
            "tensor": own.ptrs,  # a tensor of int64 addresses works like a list of them
        }[a["ptrs"]]
        nbytes = own.nbytes if a["nbytes"] == "all" else a["nbytes"]
        mem = own.local_memory()
        mem.fill_(GUARD)
        before = mem.clone()
        dist.barrier()
        made = _outcome(
            lambda: ss.SymmetricBuffer.from_peer_addresses(
                ptrs, nbytes, device=a["device"], max_views=a["max_views"], cells=a["cells"]
            )
        )
        if made[0] == "ok":  # adoption writes none of the adopted bytes: its cells live apart
            sig = made[1].cells
            made[1].close()
            made = ("ok", (sig.base, sig.size))
        dist.barrier()
        return made, bool(torch.equal(mem, before))
    finally:
        own.close()


def _valid_adopt(per_rank):
    def one(a):
        nb = (1 << 14) if a["nbytes"] == "all" else a["nbytes"]
        mv = a["max_views"]
        if not (isinstance(mv, int) and not isinstance(mv, bool) and mv > 0):
            return False
        if not isinstance(nb, int) or isinstance(nb, bool) or nb <= 0:
            return False
        return a["cells"] == "separate" and a["ptrs"] in ("real", "tensor") and a["device"] in (None, "cpu")

    same = all(per_rank[0][k] == per_rank[1][k] for k in ("nbytes", "max_views", "cells"))
    return same and all(one(a) for a in per_rank)


@settings(FUZZ, max_examples=30)
@given(per_rank=_per_rank(ADOPT_ARGS))
def test_fuzz_adopting_peer_addresses(pool, per_rank):
    results = pool.call(fuzz_adopt, per_rank, timeout_s=CALL_S)
    _assert_own_errors([r[0] for r in results], collective=True, valid=_valid_adopt(per_rank))
    assert all(r[1] for r in results), "adoption wrote outside its cells"


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
    return main, bigger, main.end + 256


def fuzz_writer(ctor, prep, write, layer):
    r = dist.get_rank()
    main, bigger, nbytes = _layouts()
    buf = ss.SymmetricBuffer(nbytes, backend="host", channels=2)
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
        other = pcp.DirectKVWriter(view, bigger, route=writer.route, channel=free)  # a second writer
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
