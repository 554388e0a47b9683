"""symmsync.moe fails closed: a bad argument (found on the host, or an expert id found on the
device) fails that call on every member (InputError on its member, PeerRefused naming it on the
others) and nothing else: the next layer is right and an all-reduce on the same view still sums,
at worlds 2 and 3, with a bite (the check blind to refusals); a member that never comes is named by a bounded
wait; construction is agreed (every rank raises, or none); a view over nodes is refused; a
member that gave up on another's abort relays it, and every member names the origin; a member
killed mid-sequence (between its dispatch and its combine) is named by every survivor within a
few seconds (its process is watched, core/liveness.py), not at the 30 s budget."""

import os
import signal
import time

import helpers
import moe_oracle as oracle  # noqa: F401 - the package's tests share the oracle's module path
import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from test_moe import make

import symmsync as ss
import symmsync.language as ssl
from symmsync import moe
from symmsync.core.nodes import NODE_SIZE_ENV
from symmsync.language import calls as ssl_calls
from symmsync.testing import Died, run

E, M, H, K = 4, 3, 32, 2


DISPATCH_CASES = {
    # name: (what the bad member passes instead of (x, ids), words of its InputError)
    "expert": (
        lambda x, ids, ne: (x, ids.index_fill(1, torch.tensor([1]), ne)),
        "topk_idx[0, 1] = {ne} is no expert id",
    ),
    "below": (lambda x, ids, ne: (x, ids.index_fill(0, torch.tensor([2]), -3)), "topk_idx[2, 0] = -3 is no expert id"),
    "tokens": (
        lambda x, ids, ne: (torch.zeros(M + 1, H, dtype=x.dtype), torch.zeros(M + 1, K, dtype=ids.dtype)),
        "more than max_tokens=3",
    ),
    "dtype": (lambda x, ids, ne: (x.float(), ids), "x must be torch.bfloat16, got torch.float32"),
    "hidden": (lambda x, ids, ne: (x[:, :16].contiguous(), ids), "x must be [tokens, hidden=32]"),
    "ids_dtype": (lambda x, ids, ne: (x, ids.int()), "topk_idx must be torch.int64, got torch.int32"),
    "ids_shape": (lambda x, ids, ne: (x, ids[:, :1].contiguous()), "topk_idx must have shape (3, 2)"),
    "noncontiguous": (lambda x, ids, ne: (torch.zeros(H, M, dtype=x.dtype).t(), ids), "x must be contiguous"),
    "meta": (lambda x, ids, ne: (x.to("meta"), ids), "x is on meta"),
    "grad": (lambda x, ids, ne: (x.float().to(x.dtype).requires_grad_(), ids), "x requires grad and grad mode is on"),
    "not_a_tensor": (lambda x, ids, ne: (x.tolist(), ids), "x must be a torch.Tensor, got list"),
}
COMBINE_CASES = {
    "out_dtype": (lambda out, w, h: (out.float(), w, h), "expert_out must be torch.bfloat16, got torch.float32"),
    "out_shape": (lambda out, w, h: (out[:, :1].contiguous(), w, h), "expert_out must have shape"),
    "weights": (lambda out, w, h: (out, w.double(), h), "topk_weights must be torch.float32, got torch.float64"),
    "handle": (lambda out, w, h: (out, w, tuple(h)), "handle must be the Handle"),
    "foreign_handle": (lambda out, w, h: (out, w, h._replace(offsets=h.offsets[:1])), "from another dispatcher"),
}


def one_layer(disp, me, world, seed):
    """A good dispatch and combine on every member, checked against the oracle: the differences."""
    import routings
    from test_moe import compare, gathered, layer

    x, ids, w = routings.routing("random", me, world, disp.num_experts, M, H, K, torch.bfloat16, seed)
    got = layer(disp, x, ids, w)
    return compare(disp, seed, got, (gathered(x), gathered(ids), gathered(w)), me)


def refusals(variant=None):
    """On one dispatcher and, on its view, one all-reduce: every kind of bad argument, made by the
    last member while the others make the good call; what each member's call raised, whether the
    next layer of every member was right, and whether the all-reduce still sums."""
    from symmsync import collectives

    me, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    nbytes = moe.buffer_bytes(2 * world, M, H, torch.bfloat16, K, world)
    buf = ss.SymmetricBuffer(nbytes + collectives.workspace_bytes(64, torch.float32, world))
    view = buf.view(list(range(world)))
    ne = 2 * world
    disp = moe.Dispatcher(view, ne, M, H, torch.bfloat16, K, timeout_s=60)
    ar = collectives.AllReduce(view, 64, torch.float32, offset=disp.workspace.nbytes)
    seen, wrong = {}, []
    swap = helpers.replaced(moe.protocol, **({"check": blind_check} if variant == "blind" else {}))
    try:
        with swap:
            for i, (name, (change, _)) in enumerate({**DISPATCH_CASES, **COMBINE_CASES}.items()):
                x = torch.randn(M, H, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
                ids = torch.tensor([[(me + t) % ne, (me + t + 1) % ne] for t in range(M)])
                try:
                    if name in DISPATCH_CASES:
                        disp.dispatch(*(change(x, ids, ne) if me == bad else (x, ids)))
                    else:
                        recv, _, handle = disp.dispatch(x, ids)
                        out, w = recv.clone(), torch.full((M, K), 0.5)
                        disp.combine(*(change(out, w, handle) if me == bad else (out, w, handle)))
                    seen[name] = ("returned", "", None)
                except ss.SymmSyncError as e:
                    seen[name] = (type(e).__name__, str(e), getattr(e, "origin", None))
                wrong += [f"after {name}: {d}" for d in one_layer(disp, me, world, 100 + i)]
        total = ar(torch.full((64,), float(me + 1)))
        summed = bool((total == world * (world + 1) / 2).all())
    finally:
        buf.close()
    return seen, wrong, summed


def _check_refusals(results, world):
    bad = world - 1
    for name, (_, words) in {**DISPATCH_CASES, **COMBINE_CASES}.items():
        kind = "dispatch" if name in DISPATCH_CASES else "combine"
        words = words.format(ne=2 * world)
        mine = results[bad][0][name]
        assert mine[0] == "InputError" and mine[1].startswith(f"rank {bad}: moe.Dispatcher.{kind}:"), (name, mine)
        assert words in mine[1], (name, mine)
        for r in range(bad):
            theirs = results[r][0][name]
            assert theirs[0] == "PeerRefused" and theirs[2] == bad, (name, r, theirs)
            assert f"rank {bad} refused its {kind}" in theirs[1], (name, r, theirs)
            if name in ("expert", "below"):  # found on the device: every member knows the entry and its value
                assert words in theirs[1], (name, r, theirs)
    for r, (_, wrong, summed) in enumerate(results):
        assert wrong == [], f"rank {r}: the next layer after a refused call: {wrong[:4]}"
        assert summed, f"rank {r}: the all-reduce on the dispatcher's view no longer sums"


@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_argument_fails_that_call_on_every_member_and_nothing_else(host_ranks, world):
    _check_refusals(host_ranks(refusals, world, timeout_s=600), world)


def test_the_refusal_check_bites(host_ranks):
    """With the read's check blind to a member's refusal, calls that must raise return (the other
    members', with nothing of the refusing member's rows; the refusing member's own when its
    expert id was found on the device): the test above must fail."""
    results = host_ranks(refusals, 2, "blind", timeout_s=600)
    returned = [name for name, got in results[0][0].items() if got[0] == "returned"]
    assert returned, f"with the check blind, some member's refused call must return: {results[0][0]}"
    with pytest.raises(AssertionError, match="returned"):
        _check_refusals(results, 2)


_C = {
    w: tl.constexpr(getattr(ssl_calls, w))
    for w in (
        "S_STATUS",
        "S_NUMBER",
        "S_KIND",
        "S_WHO",
        "S_CALLS",
        "S_ARRIVED",
        "S_WORST",
        "S_OWN",
        "S_HEADERS",
        "HEADER_WORDS",
    )
}
_S_STATUS, _S_NUMBER, _S_KIND, _S_WHO, _S_CALLS, _S_ARRIVED, _S_WORST, _S_OWN, _S_HEADERS, _HW = _C.values()


@triton.jit
def last_outcome_only(calls, me, n, KIND: tl.constexpr, status, who, SIZE: tl.constexpr, EVERY: tl.constexpr):
    """The kit's ``end_call`` that records every call's outcome over the one before, raised or not."""
    state = tl.load(calls).to(tl.pointer_type(tl.int64))
    k = tl.atomic_add(state + _S_ARRIVED, 1, sem="acq_rel", scope="gpu")
    tl.atomic_max(state + _S_WORST, status.to(tl.int64), sem="relaxed", scope="gpu")
    last = k == tl.num_programs(0) * tl.num_programs(1) - 1
    if last:
        worst = tl.atomic_xchg(state + _S_WORST, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state + _S_ARRIVED, 0, sem="relaxed", scope="gpu")
        own = tl.load(state + _S_OWN)
        worst = tl.where((worst == 1) & (own == 1), 0, worst)  # its own host refusal: not kept
        w = tl.arange(0, _HW)
        mine = tl.load(calls + 2 + me).to(tl.pointer_type(tl.int64)) + (n % 2) * SIZE * _HW
        for m in tl.static_range(SIZE):
            tl.store(state + _S_HEADERS + m * _HW + w, tl.load(mine + m * _HW + w, volatile=True))
        tl.store(state + _S_STATUS, worst)
        tl.store(state + _S_NUMBER, n.to(tl.int64))
        tl.store(state + _S_KIND, tl.full((), KIND, tl.int64))
        tl.store(state + _S_WHO, who.to(tl.int64))
        tl.store(state + _S_OWN, 0)
        tl.store(state + _S_CALLS, n.to(tl.int64) + 1)
    return last


def settled_at_synchronize(variant=None):
    """As on GPUs, where a step's outcome is read at ``synchronize()``, not after each step (the
    host backend reads it after each; the dispatcher is told not to): the last member's two
    dispatches with an expert id out of range, then a combine, then one ``synchronize()``; then a
    refusal found on the host, then ``synchronize()``; each ``synchronize()`` twice, and a good
    layer at the end. What each call raised, and the good layer's differences from the oracle."""
    me, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    buf, disp = make(2 * world, M, H, torch.bfloat16, K)
    disp._host_checks = False  # what a GPU's dispatcher does: the outcome read at synchronize()
    ne = disp.num_experts
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(me)).to(torch.bfloat16)
    ids = torch.tensor([[(me + t) % ne, (me + t + 1) % ne] for t in range(M)])
    w = torch.full((M, K), 0.5)
    seen = {}
    try:
        with helpers.replaced(ssl, **({"end_call": last_outcome_only} if variant == "last_only" else {})):
            first = ids.index_fill(1, torch.tensor([1]), ne) if me == bad else ids
            second = ids.index_fill(0, torch.tensor([2]), -3) if me == bad else ids
            seen["first dispatch"] = helpers.raised(disp.dispatch, x, first)
            seen["second dispatch"] = helpers.raised(disp.dispatch, x, second)
            recv, _, handle = disp.dispatch(x, ids)
            seen["combine"] = helpers.raised(disp.combine, recv.clone(), w, handle)
            seen["synchronize"] = helpers.raised(disp.synchronize)
            seen["synchronize again"] = helpers.raised(disp.synchronize)
            seen["host refusal"] = helpers.raised(disp.dispatch, x.float() if me == bad else x, ids)
            seen["its synchronize"] = helpers.raised(disp.synchronize)
            seen["its synchronize again"] = helpers.raised(disp.synchronize)
            wrong = one_layer(disp, me, world, 7)
            seen["last synchronize"] = helpers.raised(disp.synchronize)
    finally:
        buf.close()
    return seen, wrong


def _check_settled(results, world):
    bad = world - 1
    entry = f"topk_idx[0, 1] = {2 * world} is no expert id"
    for r, (seen, wrong) in enumerate(results):
        quiet = ["first dispatch", "second dispatch", "combine", "synchronize again", "its synchronize again"]
        quiet += ["last synchronize", "its synchronize" if r == bad else "host refusal"]
        for name in quiet:
            assert seen[name][0] == "returned", (r, name, seen[name])
        assert wrong == [], f"rank {r}: the layer after the refusals: {wrong[:4]}"
        got = seen["synchronize"]
        if r == bad:
            assert got[0] == "InputError" and got[1].startswith(f"rank {bad}: moe.Dispatcher.dispatch:"), got
            assert seen["host refusal"][0] == "InputError", seen["host refusal"]
        else:
            assert got[0] == "PeerRefused" and got[2] == bad and f"rank {bad} refused its dispatch" in got[1], got
            later = seen["its synchronize"]
            assert later[0] == "PeerRefused" and f"rank {bad} refused its dispatch" in later[1], later
            assert "x must be torch.bfloat16, got torch.float32" in later[1], later
        # the earliest refused step is named, with the one after it, whatever steps came between
        assert entry in got[1] and "1 later call failed too" in got[1], (r, got)


def test_a_refusal_read_at_synchronize_is_the_earliest_and_raises_once(host_ranks):
    _check_settled(host_ranks(settled_at_synchronize, 2, timeout_s=600), 2)


def test_the_kept_refusal_bites(host_ranks):
    """With the kit's ``end_call`` recording each step's outcome over the one before, the good combine
    after the refused dispatches hides them: ``synchronize()`` returns, and the test above must fail."""
    results = host_ranks(settled_at_synchronize, 2, "last_only", timeout_s=600)
    assert results[0][0]["synchronize"][0] == "returned", results[0][0]["synchronize"]
    with pytest.raises(AssertionError, match="returned"):
        _check_settled(results, 2)


def an_unraised_failed_wait():
    """A failed wait on the device record that no wait raised (on GPUs the wait's trap raises
    first): ``synchronize()`` fails the dispatcher instead of passing over it. One member: the
    record is written here, as the read's last program would."""
    buf, disp = make(2, M, H, torch.bfloat16, K)
    disp._host_checks = False  # the outcome read at synchronize(), as on GPUs
    x, ids = torch.zeros(M, H, dtype=torch.bfloat16), torch.zeros(M, K, dtype=torch.int64)
    try:
        disp.dispatch(x, ids)
        disp.calls.state[ssl_calls.S_STATUS] = ssl_calls.WAIT_FAILED  # call 0, a dispatch (kind 0)
        return helpers.raised(disp.synchronize), helpers.raised(disp.dispatch, x, ids)
    finally:
        buf.close()


def test_a_failed_wait_no_wait_raised_fails_the_dispatcher_at_synchronize(host_ranks):
    ((first, then),) = host_ranks(an_unraised_failed_wait, 1, timeout_s=300)
    assert first[0] == "FenceTimeout" and "moe.Dispatcher.dispatch on view [0] (call 0): a wait of" in first[1], first
    assert then[0] != "returned" and "moe.Dispatcher.dispatch on view [0] (call 0): a wait of" in then[1], then


def a_member_never_comes():
    me = dist.get_rank()
    buf, disp = make(E, M, H, torch.bfloat16, K, timeout_s=3)
    out = None
    if me == 0:
        try:
            disp.dispatch(torch.zeros(1, H, dtype=torch.bfloat16), torch.zeros(1, K, dtype=torch.int64))
            out = "returned"
        except ss.SignalTimeout as e:
            out = (type(e).__name__, e.peer, str(e))
    dist.barrier()
    buf.close()
    return out


def test_a_member_that_never_dispatches_is_named_by_a_bounded_wait():
    out, _ = run(a_member_never_comes, 2, timeout_s=120)
    assert out[0] == "SignalTimeout" and out[1] == 1 and "timed out after 3 s" in out[2], out


def disagreeing(kind):
    me = dist.get_rank()
    world = dist.get_world_size()
    buf = ss.SymmetricBuffer(moe.buffer_bytes(8, M, H, torch.bfloat16, K, world))
    view = buf.view(list(range(world)))
    args = dict(num_experts=8, max_tokens=M, hidden=H, dtype=torch.bfloat16, top_k=K)
    if kind == "experts":
        args["num_experts"] = 3  # not a multiple of the members
    elif kind == "differ":
        args["max_tokens"] = M - me % 2
    elif kind == "fit":
        args["max_tokens"] = 64
    elif kind == "programs":
        args["programs"] = 0
    try:
        moe.Dispatcher(view, **args)
        return "made"
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e)
    finally:
        buf.close()


@pytest.mark.parametrize(
    "kind, error, words",
    [
        ("experts", "ConfigError", "num_experts=3 is not a multiple of the view's 2 members"),
        ("differ", "ConfigError", "max_tokens differs across ranks"),
        ("fit", "BoundsError", "allocate symmsync.moe.buffer_bytes"),
        ("programs", "ConfigError", "programs must be"),
    ],
)
def test_construction_is_refused_on_every_rank_alike(host_ranks, kind, error, words):
    results = host_ranks(disagreeing, 2, kind, timeout_s=120)
    assert all(r[0] == error and words in r[1] for r in results), results
    assert results[0] == results[1]


def over_two_nodes():
    buf = ss.SymmetricBuffer(moe.buffer_bytes(E, M, H, torch.bfloat16, K, 4))
    try:
        moe.Dispatcher(buf.view([0, 1, 2, 3]), E, M, H, torch.bfloat16, K)
        return "made"
    except ss.ConfigError as e:
        return str(e)
    finally:
        buf.close()


def test_a_view_over_two_nodes_is_refused_clearly(host_ranks):
    results = host_ranks(over_two_nodes, 4, env={NODE_SIZE_ENV: "2"}, timeout_s=180)
    assert all("moe.Dispatcher" in r and "node" in r for r in results), results


def relayed_abort():
    """World 3: rank 2 aborts the dispatcher's view; rank 0 dispatches and gives up on rank 2's
    abort, aborting the view in turn; rank 1 dispatches late, when both flags are set. What each
    raised, and whom it names."""
    me = dist.get_rank()
    buf, disp = make(E + 2, M, H, torch.bfloat16, K, timeout_s=20)
    ids = torch.zeros(M, K, dtype=torch.int64)
    out = ("returned",)
    if me == 2:
        disp.view.abort("rank 2 gives up")
    else:
        if me == 1:
            time.sleep(1.0)  # rank 0's relay of rank 2's abort has landed by now
        try:
            disp.dispatch(torch.zeros(M, H, dtype=torch.bfloat16), ids)
        except ss.SymmSyncError as e:
            out = (type(e).__name__, str(e), getattr(e, "aborted", None))
    dist.barrier()
    buf.close()
    return out


def test_a_relayed_abort_names_the_origin_and_its_reason_on_every_member():
    results = run(relayed_abort, 3, timeout_s=180)
    reason = "rank 2 gives up"
    for rank in (0, 1):
        kind, msg, aborted = results[rank]
        assert kind == "SignalAborted", (rank, kind, msg)
        assert list(aborted) == [2] and aborted[2].startswith(reason), (rank, aborted)
        assert f"rank 2 aborted: {reason}" in msg, (rank, msg)
        assert "rank 0 aborted" not in msg and "rank 1 aborted" not in msg, (rank, msg)


# ---------------------------------------------------------------------- a member killed mid-sequence
KILLED_BUDGET_S = 30.0  # every wait's budget: a member left to it shows as 30 s
NAMED_WITHIN_S = 5.0  # every survivor raises within this of the kill


def killed_mid_sequence(victim, kill_at):
    """Layers of dispatch + combine at world 3; at layer ``kill_at`` the victim dispatches, stamps
    the time in the store and kills itself before its combine. The survivors return what their
    first failing call raised, when, and what a next call raised."""
    me = dist.get_rank()
    buf, disp = make(6, M, H, torch.bfloat16, K, timeout_s=KILLED_BUDGET_S)
    store = dist.distributed_c10d._get_default_store()
    x = torch.ones(M, H, dtype=torch.bfloat16)
    ids = torch.tensor([[(me + t) % 6, (me + t + 2) % 6] for t in range(M)], dtype=torch.int64)
    w = torch.full((M, K), 0.5)
    for n in range(10):
        try:
            recv, _, handle = disp.dispatch(x, ids)
            if me == victim and n == kill_at:
                store.set("test/moe-killed", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            disp.combine(recv, w, handle)
        except ss.SymmSyncError as e:
            at = time.time()
            err = {"type": type(e).__name__, "msg": str(e), "aborted": getattr(e, "aborted", None), "layer": n}
            try:
                disp.dispatch(x, ids)
                again = "no error"
            except ss.SymmSyncError as e2:
                again = type(e2).__name__
            killed = float(store.get("test/moe-killed").decode())
            buf.close()
            return err, at - killed, again
    buf.close()
    return "no error"


def test_a_member_killed_mid_sequence_is_named_by_every_survivor_within_seconds():
    victim, kill_at = 1, 2
    results = run(killed_mid_sequence, 3, victim, kill_at, timeout_s=180, may_die=[victim])
    assert results[victim] == Died(victim, -signal.SIGKILL), results[victim]
    for rank in (0, 2):
        got = results[rank]
        assert got != "no error", rank
        err, after, again = got
        print(f"rank {rank}: {err['type']} at layer {err['layer']}, {after:.2f} s after the kill")
        assert after < NAMED_WITHIN_S, (rank, after, err)  # not the 30 s budget
        assert err["type"] in ("SignalAborted", "PeerAborted"), (rank, err)
        assert list(err["aborted"]) == [victim] and "died" in err["aborted"][victim], (rank, err)
        assert f"rank {victim}" in err["msg"] and "died" in err["msg"], (rank, err)
        assert again in ("SignalAborted", "PeerAborted"), (rank, again)  # fails closed from then on


import triton  # noqa: E402 - the bite's variant of the check, below the tests it serves
import triton.language as tl  # noqa: E402

from symmsync.moe import protocol as _protocol  # noqa: E402

_SHIPPED_CHECK = _protocol.check


@triton.jit
def blind_check(calls, sig, me, timeout_ns, record, state, a, refused, KIND: tl.constexpr, PHASE: tl.constexpr,
                SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):  # fmt: skip
    """The shipped check, blind to a member's refusal (its status read as OK)."""
    n, status, who = _SHIPPED_CHECK(calls, sig, me, timeout_ns, record, state, a, refused, KIND, PHASE, SIZE, NSLOTS,
                                    TRAP)  # fmt: skip
    refused = status == 1
    return n, tl.where(refused, 0, status), tl.where(refused, -1, who)
