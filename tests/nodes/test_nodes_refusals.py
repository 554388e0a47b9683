"""A bad write over nodes fails that write on every member, and nothing else: 2 simulated nodes x 2
ranks (``SYMMSYNC_NODE_SIZE=2``), host backend, PCP4 over both nodes.

Rank 3 (node 1, position 1) makes a bad write of layer 0 while the others write their rows of
it, on both routes over nodes (``"direct"``: direct within a node and an exchange among the
members at a node position; ``"allgather"``: an exchange among every member): its input has the
wrong dtype (it still inserts the members' rows), or its layer is out of range (it inserts
nothing). Rank 3 raises its own error; every other member ``PeerRefused`` naming rank 3 and its
problem. Each replica's bytes are read against the reference (tests/oracles.py, plain torch from
the format rules, on poisoned replicas): layer 0 holds the good members' rows, minus what the bad
member could not insert (on the direct route: the rows of the members at its node position, in
its node's replicas; on the all-gather route: everyone's rows, in its own replica), and poison
elsewhere; layer 1, written next by every member, holds every row. The writer and the view stay
usable: no member aborted. Without the record the refusing member posts, the members' writes
return as if nothing happened, and the test fails.
"""

import helpers
import pytest
import torch
import torch.distributed as dist
from oracles import Cache, first_difference, poisoned_case

import symmsync as ss
from symmsync import pcp

NODES = {"SYMMSYNC_NODE_SIZE": "2"}  # the simulated nodes: ranks [0, 1] and [2, 3]
T, BLOCK, BAD = 16, 16, 3
CASES = {  # name: (the bad member's arguments from the good ones, its error, whether it inserts)
    "dtype": (lambda a: (a[0], a[1].float(), *a[2:]), "InputError", True),
    "layer": (lambda a: (7, *a[1:]), "BoundsError", False),
}


def refusals(route, variant=None):
    """Rank function (``SYMMSYNC_NODE_SIZE=2``); the bite's variant is put back at the end."""
    rank = dist.get_rank()
    cache = Cache(2, 2, BLOCK)
    buf = ss.SymmetricBuffer(cache.end, backend="host", channels=2)
    view = buf.view([0, 1, 2, 3])
    writer = pcp.DirectKVWriter(view, cache.layout, route=route, timeout_s=30)
    split = pcp.pcp_split(T, 4)
    seen, wrong = {}, []
    swap = helpers.refusals_posted(variant != "unposted")
    try:
        with swap:
            for i, (name, (change, _, inserts)) in enumerate(CASES.items()):
                kv, pe, ix, slots, good = poisoned_case(writer, buf, cache, split, rank, 200 + i, T)
                _, *rows, batch = good
                seen[name] = helpers.raised(writer.write, *(change(good) if rank == BAD else good))
                writer.write(1, *rows, batch)
                dist.barrier()  # every member's writes of both layers are over before the check
                members = [r for r in range(4) if r != BAD]
                if not inserts:  # what the bad member would have inserted is missing where it inserts
                    if route == "direct" and rank // 2 == BAD // 2:
                        members = [r for r in members if r % 2 != BAD % 2]
                    elif route == "allgather" and rank == BAD:
                        members = []
                theirs = [torch.cat([split.local_rows(t, r) for r in members] or [t[:0]]) for t in (kv, pe, ix)]
                mine = torch.cat([split.local_slots(slots, r) for r in members] or [slots[:0]])
                wants = (cache.expected_layer(*theirs, mine), cache.expected_layer(kv, pe, ix, slots))
                for layer, want in enumerate(wants):
                    diff = first_difference(cache.raw_layer(buf, layer), want)
                    if diff != (0, []):
                        wrong.append(f"{name}: layer {layer} of this replica differs from the reference: {diff}")
                dist.barrier()  # nobody poisons its replica while a peer still reads it
        aborted = view.failure.reason
    finally:
        buf.close()
    return seen, wrong, aborted


def _check(results, route):
    for r, (seen, wrong, aborted) in enumerate(results):
        assert wrong == [], f"rank {r}: {wrong[:4]}"
        assert aborted is None, (r, aborted)
        for name, (_, error, inserts) in CASES.items():
            got = seen[name]
            if r == BAD:
                assert got[0] == error and "wrote nothing of the layer" in got[1], (name, got)
                continue
            assert got[0] == "PeerRefused" and got[2] == BAD, (r, name, got)
            assert f"rank {BAD} refused its write: " in got[1], (r, name, got)
            assert ("must be torch.bfloat16" in got[1]) if name == "dtype" else ("layer 7" in got[1]), got
            assert ("(its layer or batch was bad)" in got[1]) != inserts, (r, name, got)


@pytest.mark.parametrize("route", ["direct", "allgather"])
def test_a_bad_write_over_nodes_fails_that_write_on_every_member_and_nothing_else(host_ranks, route):
    _check(host_ranks(refusals, 4, route, env=NODES, timeout_s=300), route)


def test_the_refusal_record_over_nodes_bites(host_ranks):
    """Without the refusing member's record, the members' writes return: the test above fails."""
    results = host_ranks(refusals, 4, "direct", "unposted", env=NODES, timeout_s=300)
    assert results[0][0]["dtype"][0] == "returned", results[0][0]
    with pytest.raises(AssertionError, match="returned"):
        _check(results, "direct")
