"""What the fuzz tests share: the junk values, hypothesis's settings, and the check that only
symmsync's own errors come out (on every rank for collective calls).

Every public entry point is fed values hypothesis draws, junk included. Ranks stay alive
across examples (RankPool); each call reports, per rank, what happened:
  ("ok", ...)                                the call was accepted
  ("raised", exception type, message)        a SymmSyncError
  ("foreign", exception type, traceback)     anything else: never allowed
Collective calls must be accepted on every rank or raise on every rank; a call that
leaves one rank waiting shows up as a pool call that does not finish (a hang).
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import symmsync as ss

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


def _per_rank(strategy):
    """The same value for both ranks, or one for each (mismatches across ranks)."""
    return st.one_of(strategy.map(lambda v: [v, v]), st.lists(strategy, min_size=2, max_size=2))


def _int_or_junk(lo, hi):
    return st.one_of(st.integers(lo, hi), st.sampled_from(JUNK))
