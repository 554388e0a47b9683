"""After a refused dispatch, the layer's combine made on every member keeps them in step (docs/moe.md,
"A refused dispatch and the layer after it"), with the outcome read at ``synchronize()`` as on GPUs;
and a failed dispatch's ``recv`` and the combine of its handle hold NaN, never the rows of an
earlier layer.

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
            out["counts"], out["recv_nan"] = counts.tolist(), bool(recv.isnan().all())
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
    assert theirs["counts"] == [0, 0] and theirs["recv_nan"] and theirs["y_nan"], theirs
    err = theirs["synchronize"]
    assert err[0] == "PeerRefused" and err[2] == 1 and "rank 1 refused its dispatch" in err[1], err
    assert "1 later call failed too" in err[1], err
    for r in results:
        assert r["wrong"] == [], r["wrong"][:4]


def device_refused_dispatch_then_combine():
    """The last member's ids hold an expert id out of range (found by its send kernel, so its dispatch
    returns too); every member combines its handle as usual, as a GPU's members would."""
    import routings
    from test_moe import compare, experts, gathered, layer

    me, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    buf, disp = make(2 * world, M, H, torch.bfloat16, K)
    ne = disp.num_experts
    out = {}
    try:
        x, ids, w = routings.routing("random", me, world, ne, M, H, K, torch.bfloat16, 3)
        for _ in range(2):  # good layers first: the failed dispatch's buffer and the combine regions hold rows
            layer(disp, x, ids, w)
        disp._host_checks = False  # what a GPU's dispatcher does: the outcome read at synchronize()
        bad_ids = ids.index_fill(1, torch.tensor([1]), ne) if me == bad else ids
        recv, counts, handle = disp.dispatch(x, bad_ids)
        out["recv_nan"] = bool(recv.isnan().all())
        y = disp.combine(experts(disp, recv), w, handle)
        out.update(counts=counts.tolist(), per_source=handle.per_source.unique().tolist(), nan=bool(y.isnan().all()))
        out["synchronize"] = helpers.raised(disp.synchronize)
        disp._host_checks = True
        x2, ids2, w2 = routings.routing("random", me, world, ne, M, H, K, torch.bfloat16, 8)
        got = layer(disp, x2, ids2, w2)
        out["wrong"] = compare(disp, 8, got, (gathered(x2), gathered(ids2), gathered(w2)), me)
    finally:
        buf.close()
    return out


def test_a_failed_dispatchs_rows_and_its_combine_are_nan_not_an_earlier_layers(host_ranks):
    results = host_ranks(device_refused_dispatch_then_combine, 2, timeout_s=300)
    for r, res in enumerate(results):
        assert res["counts"] == [0, 0] and res["per_source"] == [-1] and res["nan"], (r, res)
        assert res["recv_nan"], f"rank {r}: a failed dispatch's recv must hold NaN only, not an earlier layer's rows"
        kind = "InputError" if r == 1 else "PeerRefused"
        assert res["synchronize"][0] == kind and "is no expert id" in res["synchronize"][1], (r, res)
        assert res["wrong"] == [], res["wrong"][:4]


def fp8_failed_dispatch():
    """fp8: two good dispatches (their codes and scales finite), then one the last member's expert id
    refuses on the device: what every member's codes and scales hold, and what it raises."""
    import routings

    me, world = dist.get_rank(), dist.get_world_size()
    buf, disp = make(2 * world, M, 128, torch.bfloat16, K, fp8=True)
    ne, out = disp.num_experts, {}
    try:
        x, ids, w = routings.routing("random", me, world, ne, M, 128, K, torch.bfloat16, 5)
        zeros = torch.zeros((disp.local_experts, world * M, 128), dtype=torch.bfloat16)
        for _ in range(2):
            (codes, scales), counts, handle = disp.dispatch(x, ids)
            out.setdefault("finite", []).append(bool(scales.isfinite().any()) and int(counts.sum()) > 0)
            disp.combine(zeros, w, handle)
        disp._host_checks = False  # the outcome read at synchronize(), as on GPUs
        (codes, scales), counts, handle = disp.dispatch(x, ids.index_fill(1, torch.tensor([1]), ne) if me else ids)
        out["nan"] = bool(codes.float().isnan().all()) and bool(scales.isnan().all())
        out["y_nan"] = bool(disp.combine(zeros, w, handle).isnan().all())
        out["synchronize"] = helpers.raised(disp.synchronize)[0]
    finally:
        buf.close()
    return out


def test_a_failed_fp8_dispatchs_codes_and_scales_are_nan(host_ranks):
    results = host_ranks(fp8_failed_dispatch, 2, timeout_s=300)
    for r, res in enumerate(results):
        assert res["finite"] == [True, True], (r, res)
        assert res["nan"] and res["y_nan"], (r, res)
        assert res["synchronize"] == ("InputError" if r else "PeerRefused"), (r, res)
