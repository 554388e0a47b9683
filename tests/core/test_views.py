"""Peer views: subgroup pointer tables, their own cell regions, TP×PCP layouts, bad views."""

import pytest
import torch
import torch.distributed as dist
from helpers import need_gpus

import symmsync as ss
from symmsync.testing import run


def test_tp_pcp_order_is_pcp_major():
    # rank = pcp_rank * tp + tp_rank: TP ranks of one PCP rank are consecutive.
    assert ss.tp_pcp_ranks(0, tp=2, pcp=2) == ([0, 2], [0, 1])
    assert ss.tp_pcp_ranks(3, tp=2, pcp=2) == ([1, 3], [2, 3])
    assert ss.tp_pcp_ranks(5, tp=2, pcp=4) == ([1, 3, 5, 7], [4, 5])
    assert ss.tp_pcp_ranks(2, tp=1, pcp=4) == ([0, 1, 2, 3], [2])
    with pytest.raises(ss.ConfigError):
        ss.tp_pcp_ranks(4, tp=2, pcp=2)


def tp_pcp_views(backend="host"):
    buf = ss.SymmetricBuffer(4096, backend=backend)
    pcp = ss.pcp_view(buf, tp=2)
    tp = ss.tp_view(buf, tp=2)
    world = buf.view(list(range(buf.world_size)))
    # Write rank-stamps through the PCP view into every member, read own after a barrier.
    for i in range(pcp.size):
        pcp.tensor(16 * pcp.local_index, (2,), torch.int32, index=i).fill_(10 * buf.rank + i)
    if buf.capabilities.streams:
        torch.cuda.synchronize()
    dist.barrier()
    got = pcp.tensor(0, (pcp.size, 4), torch.int32)[:, 0].tolist()  # 16 bytes per member
    out = {
        "pcp": (list(pcp.ranks), pcp.local_index, pcp.ptrs.tolist(), pcp.cell_offset(0)),
        "tp": (list(tp.ranks), tp.local_index, tp.cell_offset(0)),
        "world_cell": world.cell_offset(1),
        "all_ptrs": buf.ptrs.tolist(),
        "got": got,
    }
    buf.close()
    return out


def test_tp2_pcp2_views_give_each_rank_its_subgroup_with_own_signal_regions(backend, host_ranks):
    need_gpus(backend, 4)
    if backend == "host":
        assert_tp_pcp_views(host_ranks(tp_pcp_views, 4, backend))
    else:
        assert_tp_pcp_views(run(tp_pcp_views, 4, backend, backend=backend))


def assert_tp_pcp_views(results):
    for rank, res in enumerate(results):
        ranks, idx, ptrs, cell = res["pcp"]
        assert ranks == [rank % 2, rank % 2 + 2] and idx == rank // 2
        assert ptrs == [res["all_ptrs"][r] for r in ranks]
        assert res["tp"][0] == [rank // 2 * 2, rank // 2 * 2 + 1] and res["tp"][1] == rank % 2
        # Three views, three cell regions: no two share a cell.
        assert len({cell, res["tp"][2], res["world_cell"]}) == 3
        assert res["got"] == [10 * m + rank // 2 for m in ranks]
    # Disjoint PCP subgroups may use the same region index: their cells are in different ranks' memory.
    assert results[0]["pcp"][3] == results[1]["pcp"][3]


def bad_view(case):
    buf = ss.SymmetricBuffer(1024, backend="host")
    r = buf.rank
    ranks = {
        "duplicate": [r, r],
        "out_of_range": [r, 7],
        "excludes_caller": [(r + 1) % 2],
        "not_ints": ["a", r],
        "inconsistent": [0, 1] if r == 0 else [1, 0],
    }[case]
    try:
        buf.view(ranks)
    except ss.ViewError as e:
        return str(e)
    finally:
        buf.close()
    return None


@pytest.mark.parametrize(
    "case,words",
    [
        ("duplicate", "repeat"),
        ("out_of_range", "outside the group"),
        ("excludes_caller", "excludes the calling rank"),
        ("not_ints", "sequence of ints"),
        ("inconsistent", "same ranks in the same order"),
    ],
)
def test_bad_views_raise_on_every_rank(case, words, host_ranks):
    msgs = host_ranks(bad_view, 2, case)
    assert all(m is not None and words in m for m in msgs), msgs


def view_limits():
    buf = ss.SymmetricBuffer(1024, backend="host", max_views=2, channels=2)
    out = {}
    try:
        ss.pcp_view(buf, tp=3)
    except ss.ConfigError as e:
        out["tp"] = str(e)
    v = buf.view([buf.rank])
    try:
        v.cell_offset(2)
    except ss.ConfigError as e:
        out["channel"] = str(e)
    buf.view([0, 1])
    try:
        buf.view([buf.rank])
    except ss.ViewError as e:
        out["regions"] = str(e)
    buf.close()
    return out


def test_layout_and_channel_and_region_limits_raise_clearly(host_ranks):
    for out in host_ranks(view_limits, 2):
        assert "tp=3" in out["tp"] and "divisor" in out["tp"]
        assert "channel 2" in out["channel"]
        assert "max_views" in out["regions"]
