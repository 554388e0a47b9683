"""symmsync.moe fails closed: bad input is refused on its rank before anything is sent and
reaches the members as PeerAborted naming it; a member that never comes is named by a bounded
wait; construction is agreed (every rank raises, or none); a view over nodes is refused; a
member that gave up on another's abort relays it, and every member names the origin; a member
killed mid-sequence (between its dispatch and its combine) is named by every survivor within a
few seconds (its process is watched, core/liveness.py), not at the 30 s budget."""

import os
import signal
import time

import moe_oracle as oracle  # noqa: F401 - the package's tests share the oracle's module path
import pytest
import torch
import torch.distributed as dist
from test_moe import make

import symmsync as ss
from symmsync import moe
from symmsync.core.nodes import NODE_SIZE_ENV
from symmsync.testing import Died, run

E, M, H, K = 4, 3, 32, 2


KINDS = ("expert", "tokens", "dtype")


def refused_on_rank_1():
    """For each kind of bad input, on a fresh dispatcher: rank 1 makes a bad dispatch, rank 0 a good
    one. Returns, per kind, what each raised, and what its next call raised."""
    me = dist.get_rank()
    seen = {}
    for kind in KINDS:
        buf, disp = make(E, M, H, torch.bfloat16, K, timeout_s=60)
        x = torch.zeros(M, H, dtype=torch.bfloat16)
        ids = torch.zeros(M, K, dtype=torch.int64)
        if me == 1:
            if kind == "expert":
                ids[1, 1] = E  # one past the last expert
            elif kind == "tokens":
                x, ids = torch.zeros(M + 1, H, dtype=torch.bfloat16), torch.zeros(M + 1, K, dtype=torch.int64)
            else:
                x = x.float()
            assert not disp.accepts(x, ids)
        try:
            disp.dispatch(x, ids)
            out = ("returned", "")
        except ss.SymmSyncError as e:
            out = (type(e).__name__, str(e), getattr(e, "aborted", None))
        try:  # the dispatcher stays failed: the next call raises again, launching nothing
            disp.dispatch(torch.zeros(M, H, dtype=torch.bfloat16), torch.zeros(M, K, dtype=torch.int64))
            again = "returned"
        except ss.SymmSyncError as e:
            again = type(e).__name__
        dist.barrier()
        buf.close()
        seen[kind] = (out, again)
    return seen


def test_a_bad_dispatch_is_refused_on_its_rank_and_reaches_the_other_as_peer_aborted():
    rank0, rank1 = run(refused_on_rank_1, 2, timeout_s=180)
    words = {
        "expert": "topk_idx[1, 1] = 4 is no expert id",
        "tokens": "more than max_tokens=3",
        "dtype": "x must be torch.bfloat16, got torch.float32",
    }
    for kind in KINDS:
        (r0, again0), (r1, again1) = rank0[kind], rank1[kind]
        assert r1[0] == "InputError" and r1[1].startswith("rank 1: moe.Dispatcher.dispatch:"), (kind, r1)
        assert words[kind] in r1[1], (kind, r1)
        assert r0[0] == "SignalAborted" and 1 in r0[2], (kind, r0)  # a PeerAborted naming rank 1 and its reason
        assert "rank 1" in r0[1] and "moe.Dispatcher.dispatch" in r0[1], (kind, r0)
        assert again1 == "InputError" and again0 in ("SignalAborted", "PeerAborted"), (kind, again0, again1)


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


def test_a_view_over_two_nodes_is_refused_clearly():
    results = run(over_two_nodes, 4, env={NODE_SIZE_ENV: "2"}, timeout_s=180)
    assert all("moe.Dispatcher" in r and "node" in r for r in results), results


def relayed_abort():
    """World 3: rank 2 dispatches a bad expert id; rank 1 dispatches late, after rank 0 gave up
    on rank 2's abort and aborted the view in turn. What each raised, and whom it names."""
    me = dist.get_rank()
    buf, disp = make(E + 2, M, H, torch.bfloat16, K, timeout_s=20)
    ids = torch.zeros(M, K, dtype=torch.int64)
    if me == 2:
        ids[0, 0] = E + 2  # one past the last expert
    if me == 1:
        time.sleep(1.0)  # rank 0's relay of rank 2's abort has landed by now
    try:
        disp.dispatch(torch.zeros(M, H, dtype=torch.bfloat16), ids)
        out = ("returned",)
    except ss.SymmSyncError as e:
        out = (type(e).__name__, str(e), getattr(e, "aborted", None))
    dist.barrier()
    buf.close()
    return out


def test_a_relayed_abort_names_the_origin_and_its_reason_on_every_member():
    results = run(relayed_abort, 3, timeout_s=180)
    assert results[2][0] == "InputError", results[2]
    reason = "moe.Dispatcher.dispatch: topk_idx[0, 0] = 6 is no expert id"
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
