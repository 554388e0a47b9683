"""After a refused dispatch, the layer's combine made on every member keeps them in step (docs/moe.md,
"A refused dispatch and the layer after it"), with the outcome read at ``synchronize()`` as on GPUs;
and the combine of a failed dispatch's handle returns NaN, never the rows of an earlier layer.

The last member's dispatch has a float32 ``x`` (refused on its host); the others' dispatch returns
(their host does not read the outcome until ``synchronize()``), with zero counts; they combine
as usual while the refusing member makes the combine with nothing (``combine(None, None, None)``,
its own ``InputError``). Every other member's ``y`` is NaN; its ``synchronize()`` raises
``PeerRefused`` naming the refusing member, the dispatch, and the combine after it; the next layer
of every member equals the oracle (tests/moe/moe_oracle.py, plain torch).
"""

import helpers
import torch
import torch.distributed as dist
from test_moe import make

E, M, H, K = 4, 3, 32, 2


def refused_dispatch_then_combine():
    import routings
    from test_moe import compare, gathered, layer

    me, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    buf, disp = make(2 * world, M, H, torch.bfloat16, K)
    disp._host_checks = False  # what a GPU's dispatcher does: the outcome read at synchronize()
    ne = disp.num_experts
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(me)).to(torch.bfloat16)
    ids = torch.tensor([[(me + t) % ne, (me + t + 1) % ne] for t in range(M)])
    out = {}
    try:
        if me == bad:
            out["dispatch"] = helpers.raised(disp.dispatch, x.float(), ids)
            out["combine"] = helpers.raised(disp.combine, None, None, None)  # the step made, with nothing
        else:
            recv, counts, handle = disp.dispatch(x, ids)
            out["counts"] = counts.tolist()
            y = disp.combine(recv.clone(), torch.full((M, K), 0.5), handle)
            out["y_nan"] = bool(y.isnan().all())
        out["synchronize"] = helpers.raised(disp.synchronize)
        disp._host_checks = True
        x2, ids2, w2 = routings.routing("random", me, world, ne, M, H, K, torch.bfloat16, 7)
        got = layer(disp, x2, ids2, w2)
        out["wrong"] = compare(disp, 7, got, (gathered(x2), gathered(ids2), gathered(w2)), me)
    finally:
        buf.close()
    return out


def test_a_refused_dispatch_may_be_followed_by_a_refused_combine(host_ranks):
    results = host_ranks(refused_dispatch_then_combine, 2, timeout_s=300)
    mine, theirs = results[1], results[0]
    assert mine["dispatch"][0] == "InputError" and "x must be torch.bfloat16" in mine["dispatch"][1], mine
    assert mine["combine"][0] == "InputError" and "handle must be the Handle" in mine["combine"][1], mine
    assert mine["synchronize"][0] == "returned", mine  # its own refusals raised at once
    assert theirs["counts"] == [0, 0] and theirs["y_nan"], theirs
    err = theirs["synchronize"]
    assert err[0] == "PeerRefused" and err[2] == 1 and "rank 1 refused its dispatch" in err[1], err
    assert "1 later call failed too" in err[1], err
    for r in results:
        assert r["wrong"] == [], r["wrong"][:4]


def device_refused_dispatch_then_combine():
    """The last member's ids hold an expert id out of range (found by its send kernel, so its dispatch
    returns too); every member combines its handle as usual, as a GPU's members would."""
    import routings
    from test_moe import compare, gathered, layer

    me, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    buf, disp = make(2 * world, M, H, torch.bfloat16, K)
    ne = disp.num_experts
    out = {}
    try:
        x, ids, w = routings.routing("random", me, world, ne, M, H, K, torch.bfloat16, 3)
        layer(disp, x, ids, w)  # a good layer first: the combine regions hold its rows
        disp._host_checks = False  # what a GPU's dispatcher does: the outcome read at synchronize()
        bad_ids = ids.index_fill(1, torch.tensor([1]), ne) if me == bad else ids
        recv, counts, handle = disp.dispatch(x, bad_ids)
        y = disp.combine(recv.clone(), w, handle)
        out.update(counts=counts.tolist(), per_source=handle.per_source.unique().tolist(), nan=bool(y.isnan().all()))
        out["synchronize"] = helpers.raised(disp.synchronize)
        disp._host_checks = True
        x2, ids2, w2 = routings.routing("random", me, world, ne, M, H, K, torch.bfloat16, 8)
        got = layer(disp, x2, ids2, w2)
        out["wrong"] = compare(disp, 8, got, (gathered(x2), gathered(ids2), gathered(w2)), me)
    finally:
        buf.close()
    return out


def test_the_combine_of_a_failed_dispatch_returns_nan_not_an_earlier_layers_rows(host_ranks):
    results = host_ranks(device_refused_dispatch_then_combine, 2, timeout_s=300)
    for r, res in enumerate(results):
        assert res["counts"] == [0, 0] and res["per_source"] == [-1] and res["nan"], (r, res)
        kind = "InputError" if r == 1 else "PeerRefused"
        assert res["synchronize"][0] == kind and "is no expert id" in res["synchronize"][1], (r, res)
        assert res["wrong"] == [], res["wrong"][:4]
