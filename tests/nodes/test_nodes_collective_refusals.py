"""A bad call of a collective over nodes fails that call on every member, and nothing else:
2 simulated nodes x 2 ranks (``SYMMSYNC_NODE_SIZE=2``), host backend, the view of all 4.

For each operation over the spanning view (the all-reduce, with and without the fused residual
+ RMS norm, the all-gather, the reduce-scatter) and for a bad member on each node (rank 1: node
0, position 1; rank 2: node 1, position 0), that member passes an input of the wrong dtype while
the others make the call right, with ``out=`` filled with a sentinel. The bad member raises
``InputError``; every other member ``PeerRefused`` naming it and its problem, whichever step
told it (its node step, the exchange between nodes, or a node step of a member that learnt it
there); every other member's ``out`` holds NaN, the bad member's keeps its sentinel (its call
raised before it launched anything). Then every member makes
the same call right, and its result is the sum (or the gathered blocks) written here in plain
torch; no member aborted the view. With the refusing member's record left unposted, the
members' calls still fail (closed, naming no member), and the test, which asks for the origin,
fails.
"""

import helpers
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C

NODES = {"SYMMSYNC_NODE_SIZE": "2"}  # the simulated nodes: ranks [0, 1] and [2, 3]
N, H = 64, 16  # elements of a call; the fused call's rows of H
SENTINEL = -7.0
OPS = ("all_reduce", "fused", "all_gather", "reduce_scatter")


def _call(ops, op, x, out):
    if op == "fused":
        residual = torch.ones(N // H, H)
        ops["all_reduce"](x.view(N // H, H), residual=residual, norm_weight=torch.ones(H), eps=1e-6, out=out)
        return out
    return ops[op](x, out=out)


def _out(op, rank):
    numel = {"all_gather": 4 * N, "reduce_scatter": N // 4}.get(op, N)
    out = torch.full((numel,), SENTINEL)
    return out.view(N // H, H) if op == "fused" else out


def _want(op):
    """The right call's result from every member's x = full(rank + 1), in plain torch."""
    if op == "all_gather":
        return torch.cat([torch.full((N,), float(r + 1)) for r in range(4)])
    if op == "reduce_scatter":
        return torch.full((N // 4,), 10.0)
    s = torch.full((N,), 10.0)
    if op == "fused":
        h = s.view(N // H, H) + 1.0
        return h / torch.sqrt(h.square().mean(-1, keepdim=True) + 1e-6)
    return s


def refusals(variant=None):
    """Rank function (``SYMMSYNC_NODE_SIZE=2``); the bite's variant is put back at the end."""
    rank = dist.get_rank()
    sizes = [
        C.workspace_bytes(N, torch.float32, 4, op, nodes=2) for op in ("all_reduce", "all_gather", "reduce_scatter")
    ]
    buf = ss.SymmetricBuffer(sum(sizes), backend="host")
    view = buf.view([0, 1, 2, 3])
    ops = {
        "all_reduce": C.AllReduce(view, N, torch.float32, offset=0, channel=0, timeout_s=30),
        "all_gather": C.AllGather(view, N, torch.float32, offset=sizes[0], channel=1, timeout_s=30),
        "reduce_scatter": C.ReduceScatter(view, N, torch.float32, offset=sizes[0] + sizes[1], channel=2, timeout_s=30),
    }
    swap = helpers.refusals_posted(not variant)
    seen, wrong = {}, []
    try:
        with swap:
            for op in OPS:
                for bad in (1, 2):
                    x = torch.full((N,), float(rank + 1))
                    out = _out(op, rank)
                    seen[op, bad] = helpers.raised(_call, ops, op, x.double() if rank == bad else x, out)
                    if rank == bad and not bool((out == SENTINEL).all()):
                        wrong.append(f"{op}, bad {bad}: the refusing rank's out was written")
                    if rank != bad and not bool(out.isnan().all()):
                        wrong.append(f"{op}, bad {bad}: this rank's out holds no NaN: {out.reshape(-1)[:4].tolist()}")
                    out = _out(op, rank)
                    try:
                        _call(ops, op, x, out)
                    except ss.SymmSyncError as e:
                        wrong.append(f"{op}, bad {bad}: the next call raised {type(e).__name__}: {str(e)[:300]}")
                        continue
                    if not torch.allclose(out.reshape(-1), _want(op).reshape(-1)):
                        wrong.append(f"{op}, bad {bad}: the next call gave {out.reshape(-1)[:8].tolist()}")
        aborted = view.failure.reason
    finally:
        buf.close()
    return seen, wrong, aborted


def _check(results):
    for r, (seen, wrong, aborted) in enumerate(results):
        assert wrong == [], f"rank {r}: {wrong[:4]}"
        assert aborted is None, (r, aborted)
        for (op, bad), got in seen.items():
            if r == bad:
                assert got[0] == "InputError" and "no member's call did anything" in got[1], (op, got)
                continue
            assert got[0] == "PeerRefused" and got[2] == bad, (r, op, bad, got)
            assert f"rank {bad} refused its call: x must be" in got[1] and "torch.float64" in got[1], (r, op, got)


def test_a_bad_call_over_nodes_fails_that_call_on_every_member_and_nothing_else(host_ranks):
    _check(host_ranks(refusals, 4, env=NODES, timeout_s=300))


def test_the_refusal_record_over_nodes_bites(host_ranks):
    """Without the refusing member's record, the members' calls still fail closed (``PeerRefused``
    naming no member, origin -1), but cannot name the origin: the test above fails."""
    results = host_ranks(refusals, 4, "unposted", env=NODES, timeout_s=300)
    got = results[0][0][("all_reduce", 1)]
    assert got[0] == "PeerRefused" and got[2] == -1 and "its record is not in" in got[1], got
    with pytest.raises(AssertionError, match="PeerRefused"):
        _check(results)
