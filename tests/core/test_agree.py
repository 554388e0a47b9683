"""The agreement of a collective call's arguments (symmsync.core.agreement.agree), alone, on three
host ranks: every rank raises the same error, or none does.

Oracles: the error class and the whole message each rank raised, written out here from the
contract (``"{call}: rank R (and ranks S): {problem}"``, ``"{call}: {field} differs across
ranks (rank 0: v, ...); {hint}"``), and the values each rank got back.
"""

import torch.distributed as dist

import symmsync as ss
from symmsync.core.agreement import Same, agree

WORLD = 3


def _outcome(call):
    try:
        return ("returned", call())
    except ss.SymmSyncError as e:
        return ("raised", type(e).__name__, str(e))


PROBLEMS = {1: ("closed here", ss.ClosedError), 2: ("n must be positive", ss.ConfigError)}


def problems_on_ranks_1_and_2():
    me = dist.get_rank()
    problem, error = PROBLEMS.get(me, (None, ss.ConfigError))
    values = {"n": me}  # they differ too: a problem is raised before any field is compared
    return _outcome(
        lambda: agree(dist.group.WORLD, "Planted", values, problem=problem, error=error, same={"n": Same()})
    )


def test_a_problem_on_one_rank_raises_its_error_class_and_text_on_every_rank(host_ranks):
    want = ("raised", "ClosedError", "Planted: rank 1 (and rank 2): closed here")
    assert host_ranks(problems_on_ranks_1_and_2, WORLD) == [want] * WORLD


def field_that_differs_on_rank_1():
    me = dist.get_rank()
    values = {"channel": 0, "nbytes": 8192 if me == 1 else 4096}
    sizes = Same(ss.SizeMismatchError, "compute it from values that agree")
    return _outcome(lambda: agree(dist.group.WORLD, "Planted", values, same={"channel": Same(), "nbytes": sizes}))


def test_a_field_that_differs_raises_on_every_rank_naming_each_ranks_value(host_ranks):
    msg = (
        "Planted: nbytes differs across ranks (rank 0: 4096, rank 1: 8192, rank 2: 4096); "
        "compute it from values that agree"
    )
    assert host_ranks(field_that_differs_on_rank_1, WORLD) == [("raised", "SizeMismatchError", msg)] * WORLD


def members_compared_among_themselves(differ):
    me = dist.get_rank()
    members = (0, 1) if me < 2 else (2,)  # two views: ranks 0 and 1, and rank 2 alone
    n = {0: 7, 1: 8 if differ else 7, 2: 9}[me]
    rule = Same(among=members, hint=f"every member of {list(members)} must pass the same")
    return _outcome(lambda: agree(dist.group.WORLD, "Planted", {"n": n}, same={"n": rule}))


def test_a_subset_of_members_is_compared_only_among_themselves(host_ranks):
    # Rank 2 passes another n than ranks 0 and 1, but it is not their member: every rank gets every value.
    want = ("returned", [{"n": 7}, {"n": 7}, {"n": 9}])
    assert host_ranks(members_compared_among_themselves, WORLD, False) == [want] * WORLD
    # Ranks 0 and 1 differ: they raise naming their own values only; rank 2, not a member, returns.
    got = host_ranks(members_compared_among_themselves, WORLD, True)
    msg = "Planted: n differs across ranks (rank 0: 7, rank 1: 8); every member of [0, 1] must pass the same"
    assert got[:2] == [("raised", "ConfigError", msg)] * 2
    assert got[2] == ("returned", [{"n": 7}, {"n": 8}, {"n": 9}])
