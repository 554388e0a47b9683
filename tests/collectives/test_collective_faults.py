"""symmsync.collectives on the host backend: calls that differ, aborts, timeouts, bad arguments.

* members whose calls differ in size, dtype, algorithm, input kind or operation: every
  member raises ``CollectiveMismatch`` naming the members and what differs, nothing is
  summed (the output holds NaN), no member hangs, and every later call raises that
  first failure again;
* an abort in the middle of a run of calls reaches every member at once; a member that
  never calls makes the others time out naming it;
* bad arguments: at construction ``ConfigError`` / ``BoundsError`` on every rank; in a call
  (every input check of the three operations, worlds 2 and 3) ``InputError`` on the caller and
  ``PeerRefused`` naming it on the others, and nothing else: the next call of every operation on
  the view is right (with a bite: the kernel blind to a refusal);
* an abort relayed by a member that gave up on it names its origin and reason on every member;
* a timeout whose own launch did not publish says so, never that members did not come.
"""

import time

import helpers
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C

N = 1024


def _setup(timeout_s=60, n=N):
    world = dist.get_world_size()
    per = C.workspace_bytes(n, torch.float32, world)
    buf = ss.SymmetricBuffer(2 * per, backend="host")
    view = buf.view(list(range(world)))
    ar = C.AllReduce(view, n, torch.float32, "one_shot", timeout_s=timeout_s)
    # The same channel: their calls form one sequence, so a member calling the other
    # operation is seen by the headers.
    ag = C.AllGather(view, n, torch.float32, offset=per, channel=0, timeout_s=timeout_s)
    return buf, view, ar, ag


def _error(e):
    return {"type": type(e).__name__, "msg": str(e), "differs": getattr(e, "differs", None)}


# ---------------------------------------------------------------------- calls that differ
def differing_call(case):
    buf, view, ar, ag = _setup()
    rank = dist.get_rank()
    odd = rank == dist.get_world_size() - 1  # the last member calls differently
    numel, dtype, algorithm, sym, op = 512, torch.bfloat16, "one_shot", False, "ar"
    if odd:
        if case == "size":
            numel = 513
        elif case == "dtype":
            dtype = torch.float16
        elif case == "algorithm":
            algorithm = "two_shot"
        elif case == "input":
            sym = True
        elif case == "operation":
            op = "ag"
        elif case == "epilogue":
            op = "ar_fused"
    ar(torch.ones(8, dtype=torch.float32))  # a good call first: the mismatch is the second
    x = torch.full((numel,), 1.0 + rank, dtype=dtype)
    if sym:
        t = (ar if op == "ar" else ag).input(numel, dtype)
        t.copy_(x)
        x = t
    out = torch.full((numel,), -7.0, dtype=dtype) if op.startswith("ar") else None
    result = {}
    try:
        if op == "ar_fused":
            w = torch.ones(numel, dtype=dtype)
            ar(x, out, residual=torch.zeros(numel, dtype=dtype), norm_weight=w)
        elif op == "ar":
            ar(x, out, algorithm=algorithm)
        else:
            ag(x)
        result["first"] = "returned"
    except C.CollectiveMismatch as e:
        result["first"] = _error(e)
    if out is not None:
        result["out_nan"] = bool(out.isnan().all())
    try:
        ar(torch.ones(8, dtype=torch.float32))
        result["later"] = "returned"
    except ss.SymmSyncError as e:
        result["later"] = _error(e)
    buf.close()
    return result


@pytest.mark.parametrize(
    "case, field",
    [
        ("size", "numel"),
        ("dtype", "dtype"),
        ("algorithm", "algorithm"),
        ("input", "input"),
        ("operation", "operation"),
        ("epilogue", "epilogue"),
    ],
)
def test_a_call_that_differs_on_one_member_raises_on_every_member_naming_what_differs(case, field, host_ranks):
    results = host_ranks(differing_call, 3, case)
    for rank, r in enumerate(results):
        first = r["first"]
        assert isinstance(first, dict) and first["type"] == "CollectiveMismatch", (rank, r)
        # (operation: the last member's AllGather takes the epoch the others' AllReduce waits for, and its
        # AllReduce's next call may post before they check; then its header differs in size, not in kind)
        assert field in first["differs"] or (case == "operation" and rank < 2), (rank, first)
        assert f"rank {rank}: AllReduce on view [0, 1, 2]" in first["msg"] or case == "operation", first["msg"]
        assert "rank 0: " in first["msg"] and "rank 2: " in first["msg"], first["msg"]
        assert r.get("out_nan", True), (rank, "a call whose members differ must leave NaN in its outputs")
        if case == "operation" and rank == 2:  # its mismatch was its AllGather's: its AllReduce then meets the abort
            assert r["later"]["type"] == "PeerAborted", (rank, r["later"])
        else:
            assert r["later"] == first, (rank, r["later"])  # the collective fails closed: its first failure again


def test_a_size_mismatch_message_names_each_members_size(host_ranks):
    results = host_ranks(differing_call, 2, "size", timeout_s=180)
    for r in results:
        msg = r["first"]["msg"]
        assert r["first"]["differs"] == ["numel"], r
        assert "numel: rank 0: 512, rank 1: 513" in msg, msg
        assert "nothing of the call was read" in msg, msg


# ---------------------------------------------------------------------- aborts and timeouts
def abort_in_the_middle(aborter, at, calls, how="abort"):
    buf, view, ar, ag = _setup()
    rank = dist.get_rank()
    for k in range(calls):
        if rank == aborter and k == at:
            if how == "close":
                buf.close()
            else:
                view.abort("the model hit a NaN")
            return {"aborted_at": k}
        t0 = time.monotonic()
        try:
            ar(torch.full((N,), float(rank)))
        except ss.PeerAborted as e:
            return {"call": k, "aborted": e.aborted, "elapsed": time.monotonic() - t0, "msg": str(e)}
    return "no abort seen"


@pytest.mark.parametrize("how, reason", [("abort", "the model hit a NaN"), ("close", "closed")])
def test_an_abort_or_a_close_in_the_middle_of_a_run_reaches_every_member_at_once(how, reason, host_ranks):
    results = host_ranks(abort_in_the_middle, 3, 1, 4, 8, how)
    assert results[1] == {"aborted_at": 4}
    for rank in (0, 2):
        r = results[rank]
        assert isinstance(r, dict) and r["call"] == 4, (rank, r)
        assert r["aborted"] == {1: reason}, (rank, r)
        assert r["elapsed"] < 30, (rank, r)  # within a poll, not the 60 s budget


def never_calls(absent, budget):
    buf, view, ar, ag = _setup(timeout_s=budget)
    ar(torch.ones(4))
    if dist.get_rank() == absent:
        dist.barrier()  # alive, its buffer open, but never makes the second call: until the others gave up
        buf.close()
        return "absent"
    try:
        ar(torch.ones(4))
        out = "returned"
    except ss.FenceTimeout as e:
        out = {"type": type(e).__name__, "late": e.late}
    dist.barrier()
    buf.close()
    return out


def test_a_member_that_never_calls_makes_the_others_time_out_naming_it(host_ranks):
    results = host_ranks(never_calls, 2, 1, 2.0, timeout_s=180)
    assert results[1] == "absent"
    assert results[0] == {"type": "FenceTimeout", "late": {1: 1}}, results


# ---------------------------------------------------------------------- bad arguments
def bad_construction(case):
    world = dist.get_world_size()
    rank = dist.get_rank()
    buf = ss.SymmetricBuffer(C.workspace_bytes(N, torch.float32, world), backend="host")
    view = buf.view(list(range(world)))
    kw = {"max_numel": N, "dtype": torch.float32}
    if case == "zero_numel" and rank == 1:
        kw["max_numel"] = 0
    if case == "max_numel_differs" and rank == 1:
        kw["max_numel"] = N // 2
    if case == "too_big":
        kw["max_numel"] = 4 * N
    if case == "dtype" and rank == 0:
        kw["dtype"] = torch.int32
    try:
        C.AllReduce(view, **kw)
        return "built"
    except ss.ConfigError as e:
        return (type(e).__name__, str(e))
    finally:
        buf.close()


@pytest.mark.parametrize(
    "case, kind, text",
    [
        ("zero_numel", "ConfigError", "rank 1: max_numel must be positive"),
        ("max_numel_differs", "ConfigError", "max_numel differs across ranks (rank 0: 1024, rank 1: 512)"),
        ("too_big", "BoundsError", "allocate symmsync.collectives.workspace_bytes"),
        ("dtype", "ConfigError", "rank 0: dtype must be one of"),
    ],
)
def test_a_bad_construction_argument_raises_on_every_rank(case, kind, text, host_ranks):
    results = host_ranks(bad_construction, 2, case, timeout_s=180)
    for r in results:
        assert r[0] == kind and text in r[1], r


BAD_CALLS = {
    # name: (what the bad member calls, words of its InputError)
    "dtype": (
        lambda ar, ag, rs: ar(torch.ones(8, dtype=torch.int32)),
        "x must be float32, bfloat16 or float16, got torch.int32",
    ),
    "too_many": (
        lambda ar, ag, rs: ar(torch.ones(N + 1)),
        "x has 1025 elements, more than the 1024 torch.float32 elements the workspace holds",
    ),
    "not_contiguous": (lambda ar, ag, rs: ar(torch.ones(16, 2)[:, 0]), "x must be contiguous"),
    "not_a_tensor": (lambda ar, ag, rs: ar([1.0, 2.0]), "x must be a torch.Tensor, got list"),
    "out": (
        lambda ar, ag, rs: ar(torch.ones(N // 2), torch.empty(3)),
        "out must have 512 elements, got 3 (shape (3,))",
    ),
    "grad": (lambda ar, ag, rs: ar(torch.ones(8, requires_grad=True)), "x requires grad and grad mode is on"),
    "algorithm": (lambda ar, ag, rs: ar(torch.ones(8), algorithm="three_shot"), "algorithm must be one of"),
    "fused_shape": (
        lambda ar, ag, rs: ar(torch.ones(4, 8), residual=torch.ones(8), norm_weight=torch.ones(8)),
        "residual must have shape (4, 8)",
    ),
    "two_shot_fused": (
        lambda ar, ag, rs: ar(
            torch.ones(4, 8), residual=torch.ones(4, 8), norm_weight=torch.ones(8), algorithm="two_shot"
        ),
        "the fused epilogue runs one-shot",
    ),
    "two_shot_dtype": (
        lambda ar, ag, rs: ar(torch.ones(8).double(), algorithm="two_shot"),
        "x must be float32, bfloat16 or float16",
    ),
    "gather_dtype": (lambda ar, ag, rs: ag(torch.ones(8).double()), "x must be float32, bfloat16 or float16"),
    "scatter_split": (lambda ar, ag, rs: rs(torch.ones(7)), "x has 7 elements, not a multiple of the view's"),
}
GOOD_CALLS = {  # what the other members call meanwhile: the same operation and form
    "fused_shape": lambda ar, ag, rs: ar(torch.ones(4, 8), residual=torch.ones(4, 8), norm_weight=torch.ones(8)),
    "two_shot_fused": lambda ar, ag, rs: ar(torch.ones(4, 8), residual=torch.ones(4, 8), norm_weight=torch.ones(8)),
    "two_shot_dtype": lambda ar, ag, rs: ar(torch.ones(N // 2), algorithm="two_shot"),  # two phases
    "gather_dtype": lambda ar, ag, rs: ag(torch.ones(8)),
    "scatter_split": lambda ar, ag, rs: rs(torch.ones(6 * dist.get_world_size())),
}


def bad_calls(variant=None, timeout_s=60):
    """World 2 or 3, one all-reduce, all-gather and reduce-scatter on one view (channels 0, 1, 2):
    for each bad call, the last member makes it while the others make the good one; what each
    raised. After each, a good call of all three on every member, checked against the members'
    sum (the next call is right, the other consumers untouched). ``variant``: the refusal check
    taken out of the kernel (a bite)."""
    import symmsync.language as ssl

    world, rank = dist.get_world_size(), dist.get_rank()
    per = C.workspace_bytes(N, torch.float32, world)
    buf = ss.SymmetricBuffer(3 * per, backend="host")
    view = buf.view(list(range(world)))
    ar = C.AllReduce(view, N, torch.float32, "auto", timeout_s=timeout_s)
    ag = C.AllGather(view, N, torch.float32, offset=per, channel=1, timeout_s=timeout_s)
    rs = C.ReduceScatter(view, N, torch.float32, offset=2 * per, channel=2, timeout_s=timeout_s)
    seen, wrong = {}, []
    swap = helpers.replaced(ssl, **({"check_call": never_refused} if variant == "blind" else {}))
    try:
        with swap:
            for i, (name, (bad, _)) in enumerate(BAD_CALLS.items()):
                good = GOOD_CALLS.get(name, lambda ar, ag, rs: ar(torch.ones(N // 2)))
                try:
                    (bad if rank == world - 1 else good)(ar, ag, rs)
                    seen[name] = ("returned", "", None)
                except ss.SymmSyncError as e:
                    seen[name] = (type(e).__name__, str(e), getattr(e, "origin", None))
                x = torch.full((6 * world,), float(rank + 1 + i))
                total = sum(float(r + 1 + i) for r in range(world))
                try:
                    if not bool((ar(x) == total).all()):
                        wrong.append(f"after {name}: the all-reduce")
                    if ag(x).tolist() != [float(r + 1 + i) for r in range(world) for _ in range(6 * world)]:
                        wrong.append(f"after {name}: the all-gather")
                    if not bool((rs(x) == total).all()):
                        wrong.append(f"after {name}: the reduce-scatter")
                except ss.SymmSyncError as e:
                    wrong.append(f"after {name}: {type(e).__name__}: {str(e)[:160]}")
                    break
    finally:
        buf.close()
    return seen, wrong


def _check_bad_calls(results, world):
    bad = world - 1
    for r, (_, wrong) in enumerate(results):
        assert wrong == [], f"rank {r}: the calls after a refused one: {wrong[:4]}"
    for name, (_, text) in BAD_CALLS.items():
        got = results[bad][0][name]
        assert got[0] == "InputError" and text in got[1], (name, got)
        for r in range(bad):
            theirs = results[r][0][name]
            assert theirs[0] == "PeerRefused" and theirs[2] == bad, (name, r, theirs)
            assert f"rank {bad} refused its call" in theirs[1], (name, r, theirs)


@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_call_fails_that_call_on_every_member_and_nothing_else(world, host_ranks):
    _check_bad_calls(host_ranks(bad_calls, world, timeout_s=300), world)


def test_the_refusal_check_bites(host_ranks):
    """With the kernel blind to the call headers (every call taken as good), a refused call is read
    as data: the members sum the refusing member's stale slot and raise nothing."""
    results = host_ranks(bad_calls, 2, "blind", 5, timeout_s=300)
    print([r[0] for r in results])  # shown with -s: what went wrong instead
    with pytest.raises(AssertionError):
        _check_bad_calls(results, 2)


# ---------------------------------------------------------------------- a relayed abort
def relayed_abort():
    """World 3, an all-reduce (channel 0) and an all-gather (channel 1) on one view: rank 2 aborts
    the view; rank 0 calls the all-gather, which raises naming rank 2, and calls it again, which
    aborts the view in turn (a relay: rank 0 never published the all-reduce's epoch); rank 1
    calls the all-reduce late, when both flags are there. What each first call raised, and whom
    it names."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per = C.workspace_bytes(N, torch.float32, world)
    buf = ss.SymmetricBuffer(2 * per, backend="host")
    view = buf.view(list(range(world)))
    ar = C.AllReduce(view, N, torch.float32, "one_shot", timeout_s=20)
    ag = C.AllGather(view, N, torch.float32, offset=per, channel=1, timeout_s=20)
    if rank == 1:
        time.sleep(1.0)  # rank 0's relay has landed by now
    out = {"type": "returned"}
    if rank == 2:
        view.abort("the model hit a NaN")
    else:
        try:
            if rank == 0:
                ag(torch.ones(8))
            else:
                ar(torch.ones(8))
        except ss.SymmSyncError as e:
            out = {"type": type(e).__name__, "msg": str(e), "aborted": getattr(e, "aborted", None)}
    if rank == 0:
        with pytest.raises(ss.PeerAborted):
            ag(torch.ones(8))  # raises its first failure again, and aborts the view: a relay
    dist.barrier()
    buf.close()
    return out


def test_a_relayed_abort_names_the_origin_and_its_reason_on_every_member(host_ranks):
    results = host_ranks(relayed_abort, 3, timeout_s=180)
    reason = "the model hit a NaN"
    for rank in (0, 1):
        r = results[rank]
        assert r["type"] == "PeerAborted", (rank, r)
        assert list(r["aborted"]) == [2] and r["aborted"][2] == reason, (rank, r["aborted"])
        assert "rank 2 aborted" in r["msg"] and reason in r["msg"], (rank, r["msg"])
        assert "rank 0 aborted" not in r["msg"], (rank, r["msg"])


# ---------------------------------------------------------------------- a launch that did not publish
def stale_counter():
    """Every member's reduce-scatter finds bits in its arrival counter that are not its launch's
    (planted after construction, as bytes an earlier owner left there would be): its launch
    reaches the wait without publishing, on every member. What each call raised."""
    world = dist.get_world_size()
    buf = ss.SymmetricBuffer(C.workspace_bytes(N, torch.float32, world), backend="host")
    rs = C.ReduceScatter(buf.view(list(range(world))), N, torch.float32, timeout_s=2)
    buf.tensor(rs.workspace.counter, (1,), torch.int64).fill_(12345)
    try:
        rs(torch.ones(16))
        out = {"type": "returned"}
    except ss.SymmSyncError as e:
        out = {"type": type(e).__name__, "msg": str(e)}
    dist.barrier()
    buf.close()
    return out


def test_a_timeout_whose_own_launch_did_not_publish_says_so_and_not_that_members_never_came(host_ranks):
    for rank, r in enumerate(host_ranks(stale_counter, 2, timeout_s=120)):
        assert r["type"] == "FenceTimeout", (rank, r)
        assert "this rank did not publish epoch 1 itself (its epoch counter holds 0)" in r["msg"], (rank, r["msg"])
        assert "never reached" not in r["msg"] and "did not reach this fence" not in r["msg"], (rank, r["msg"])


import triton  # noqa: E402 - the bite's variant of the refusal check
import triton.language as tl  # noqa: E402


@triton.jit
def never_refused(calls, me, n, KIND: tl.constexpr, a, b, c, d, refused, SIZE: tl.constexpr):
    """``check_call`` that takes every call as good."""
    return tl.full((), 0, tl.int64), tl.full((), -1, tl.int64)


def refused_in_bfloat16():
    """A bfloat16 all-reduce (its bits travel as int16 under the interpreter): rank 1 passes a
    float64 input, then both call right. What each call raised or returned."""
    world, rank = dist.get_world_size(), dist.get_rank()
    buf = ss.SymmetricBuffer(C.workspace_bytes(N, torch.bfloat16, world), backend="host")
    ar = C.AllReduce(buf.view(list(range(world))), N, torch.bfloat16, timeout_s=60)
    out = []
    for bad in (True, False):
        x = torch.full((64,), float(rank + 1), dtype=torch.bfloat16)
        try:
            out.append(ar(x.double() if bad and rank == 1 else x).tolist())
        except ss.SymmSyncError as e:
            out.append(type(e).__name__)
    buf.close()
    return out


def test_a_refused_call_of_a_bfloat16_collective_fails_once_and_the_next_sums(host_ranks):
    assert host_ranks(refused_in_bfloat16, 2) == [["PeerRefused", [3.0] * 64], ["InputError", [3.0] * 64]]
