"""The Signals host API fed bad input by hypothesis, on the host backend: bad slots, budgets
and views (per rank, mismatches included) when it is made, bad peers, slots, values,
operations and comparisons when it is used. Only symmsync's own exceptions come out, on every
rank for the collective construction, with no hang; valid input is accepted and works.
"""

import os

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import symmsync as ss

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm view of POSIX shm")

JUNK = [None, 1.5, float("nan"), "2", b"x", [], object(), True, -(2**70), 2**70]
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CALL_S = 60


def _outcome(call):
    import traceback

    try:
        value = call()
    except ss.SymmSyncError as e:
        return ("raised", type(e).__name__, str(e))
    except Exception as e:  # noqa: BLE001 - the one thing these tests must never see
        return ("foreign", type(e).__name__, traceback.format_exc())
    return ("ok", value)


def _assert_own_errors(outcomes, collective, valid):
    kinds = [o[0] for o in outcomes]
    assert "foreign" not in kinds, "\n".join(o[2] for o in outcomes if o[0] == "foreign")
    if collective:
        assert len(set(kinds)) == 1, f"some ranks raised, some did not: {outcomes}"
    want = "ok" if valid else "raised"
    assert all(k == want for k in kinds), f"expected {want} on every rank: {outcomes}"
    for o in outcomes:
        if o[0] == "raised":
            assert "rank" in o[2] and "Signals" in o[2], o


def _per_rank(strategy):
    return st.one_of(strategy.map(lambda v: [v, v]), st.lists(strategy, min_size=2, max_size=2))


MAKE_ARGS = st.fixed_dictionaries(
    {
        "slots": st.one_of(st.integers(-2, 5000), st.sampled_from(JUNK)),
        "timeout_s": st.one_of(st.none(), st.sampled_from([0, -1, 0.5, 30, 1e9, 1e10, True, "5", float("inf")])),
        "view": st.sampled_from(["view", "view", "view", "closed", "aborted", "junk", "buffer"]),
    }
)


def _valid_make(per_rank):
    def ok(a):
        s, t = a["slots"], a["timeout_s"]
        good_slots = isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 4096
        good_t = t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 1e9)
        return good_slots and good_t and a["view"] == "view"

    same = repr(per_rank[0]["slots"]) == repr(per_rank[1]["slots"]) and repr(per_rank[0]["timeout_s"]) == repr(
        per_rank[1]["timeout_s"]
    )
    return all(ok(a) for a in per_rank) and same


def fuzz_make(per_rank):
    a = per_rank[dist.get_rank()]
    buf = ss.SymmetricBuffer(1024, backend="host")
    view = buf.view([0, 1])
    arg = {"view": view, "junk": object(), "buffer": buf}.get(a["view"], view)
    if a["view"] == "aborted":
        view.failure.abort_quietly("fuzzed")
    if a["view"] == "closed":
        buf.close()

    def make():
        sigs = ss.Signals(arg, slots=a["slots"], timeout_s=a["timeout_s"])
        sigs.signal(1 - buf.rank, sigs.slots - 1, 3)
        dist.barrier()
        sigs.wait(1 - buf.rank, sigs.slots - 1, 3, "EQ")
        return (sigs.slots, sigs.values()[1 - buf.rank, sigs.slots - 1].item())

    try:
        return _outcome(make)
    finally:
        buf.close()


@FUZZ
@given(per_rank=_per_rank(MAKE_ARGS))
def test_fuzz_signals_construction(pool, per_rank):
    outcomes = pool.call(fuzz_make, per_rank, timeout_s=CALL_S)
    _assert_own_errors(outcomes, collective=True, valid=_valid_make(per_rank))
    for o in outcomes:
        if o[0] == "ok":
            assert o[1][1] == 3  # the signal landed where the wait found it


USE_ARGS = st.fixed_dictionaries(
    {
        "peer": st.one_of(st.integers(-2, 3), st.sampled_from(JUNK)),
        "slot": st.one_of(st.integers(-2, 5), st.sampled_from(JUNK)),
        "value": st.one_of(st.integers(-(2**64), 2**64), st.sampled_from(JUNK)),
        "op": st.sampled_from(["add", "set", "ADD", "or", None, 1]),
        "cmp": st.sampled_from(["EQ", "NE", "GE", "GT", "LE", "LT", "ge", "==", None, 2]),
        "call": st.sampled_from(["signal", "wait", "wait_count"]),
    }
)
SLOTS = 3


def _valid_use(a):
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not (is_int(a["peer"]) and 0 <= a["peer"] < 2 and is_int(a["slot"]) and 0 <= a["slot"] < SLOTS):
        return False
    v = a["value"]
    if not is_int(v) or not -(2**63) <= v < 2**63:
        return False
    if a["call"] == "signal":
        return a["op"] in ("add", "set")
    if a["call"] == "wait_count":
        return v >= 0
    return a["cmp"] in ("EQ", "NE", "GE", "GT", "LE", "LT")


def fuzz_use(a):
    buf = ss.SymmetricBuffer(1024, backend="host")
    sigs = ss.Signals(buf.view([0, 1]), slots=SLOTS, timeout_s=30)
    valid = _valid_use(a)

    def use():
        if a["call"] == "signal":
            sigs.signal(a["peer"], a["slot"], a["value"], op=a["op"])
        elif a["call"] == "wait_count":
            # a count the slot can meet: this rank signals itself first when the input is valid
            if valid:
                sigs.signal(sigs.view.local_index, a["slot"], a["value"] if a["value"] > 0 else 0)
            sigs.wait_count(sigs.view.local_index if valid else a["peer"], a["slot"], a["value"])
        else:  # an absolute wait that holds at once for valid input: slot 0 against the int64 minimum
            value = -(2**63) if valid else a["value"]
            sigs.wait(a["peer"], a["slot"], value, "GE" if valid else a["cmp"])
        return sigs.values().sum().item()

    try:
        return _outcome(use)
    finally:
        buf.close()


@FUZZ
@given(a=USE_ARGS)
def test_fuzz_signals_host_calls(pool, a):
    outcomes = pool.call(fuzz_use, a, timeout_s=CALL_S)
    _assert_own_errors(outcomes, collective=False, valid=_valid_use(a))


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(2, timeout_s=120)
