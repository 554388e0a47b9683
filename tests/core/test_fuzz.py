"""Every public entry point of the core fed bad input by hypothesis, on the host backend (the
writer's and the PCP helpers': tests/pcp/test_pcp_fuzz.py).

Only symmsync's own exceptions come out, on every rank for collective calls, with no
hang and no byte written outside what the call may write. Ranks stay alive across
examples (the session's pool of 2 ranks, :class:`symmsync.testing.RankPool`: tests/conftest.py).
"""

import os

import pytest
import torch
import torch.distributed as dist
from fuzzing import CALL_S, FUZZ, GUARD, JUNK, _assert_own_errors, _int_or_junk, _outcome, _per_rank
from hypothesis import given, settings
from hypothesis import strategies as st

import symmsync as ss

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm view of POSIX shm")


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(2, timeout_s=120)


# SymmetricBuffer(nbytes, backend, max_views, channels, backend_options, device)


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
