"""Who owns which bytes: claims of a buffer's user region, refused on every rank where they overlap.

Host backend, world 2. The oracles are the rule docs/concepts.md ("Who owns which bytes")
states, written here as plain arithmetic over byte ranges: a refusal is a ``ConfigError`` on
every rank naming both owners and both ranges; the one sharing it allows (collectives of one
layout on one view and channel) gives every call the plain-torch sum of the members' inputs.
Every consumer's ``close()`` gives its bytes back on every rank at once: another consumer of
another layout is made over them right after, and the closed one's calls raise ``ClosedError``.
"""

import random
import time

import pytest
import torch
import torch.distributed as dist
from oracles import first_difference

import symmsync as ss
from symmsync import collectives as C
from symmsync import moe, pcp

N = 64  # elements of every collective here
F32 = torch.float32


@pytest.fixture(scope="module")
def pool(shared_pool):
    """The session's ranks of this world and environment (tests/conftest.py), shared with other modules."""
    return shared_pool(2, timeout_s=240)


def _outcome(fn):
    """``("ok", value)`` or ``(error type name, message)``."""
    try:
        return ("ok", fn())
    except ss.SymmSyncError as e:
        return (type(e).__name__, str(e))


def _ranges_named(message: str, *ranges: tuple[int, int]) -> bool:
    return all(f"[{a}, {b})" in message for a, b in ranges)


# ---------------------------------------------------------------------------- carve
def test_carve_places_each_region_aligned_after_the_last():
    sizes = {"a": 100, "b": 0, "c": 1000, "d": 129}
    plan = ss.carve(start=8, **sizes)
    at = 8
    for name, n in sizes.items():
        start = -(-at // 128) * 128  # the rule: the next multiple of 128 at or after the last stop
        assert plan[name] == start and plan.span(name) == (start, start + n)
        at = start + n
    assert plan.nbytes == at and list(plan) == list(sizes)
    assert ss.carve(align=16, x=1, y=1).span("y") == (16, 17)
    for bad in ({"align": 0}, {"start": -1}, {"x": -5}, {"x": 1.5}):
        with pytest.raises(ss.ConfigError, match="symmsync.carve"):
            ss.carve(**bad)


# ---------------------------------------------------------------------------- refusals
def overlapping_collectives() -> dict:
    """The new user's cases: an all-gather at the all-reduce's offset on another channel, at
    a part of it, and at its own bytes from carve()."""
    w = dist.get_world_size()
    ar_bytes, ag_bytes = C.workspace_bytes(N, F32, w), C.workspace_bytes(N, F32, w, "all_gather")
    plan = ss.carve(ar=ar_bytes, ag=ag_bytes)
    seen = {}
    with ss.SymmetricBuffer(plan.nbytes + ag_bytes, backend="host") as buf:
        view = buf.view(list(range(w)))
        ar = C.AllReduce(view, N, F32, offset=plan["ar"], channel=0)
        seen["ar"] = (ar.workspace.offset, ar.workspace.offset + ar.workspace.nbytes)
        seen["same offset"] = _outcome(lambda: C.AllGather(view, N, F32, offset=0, channel=1))
        seen["part"] = _outcome(lambda: C.AllGather(view, N, F32, offset=plan["ar"] + 128 * 4, channel=1))
        ag = C.AllGather(view, N, F32, offset=plan["ag"], channel=1)
        seen["ag"] = (ag.workspace.offset, ag.workspace.offset + ag.workspace.nbytes)
        seen["owners"] = [(r.owner, r.start, r.stop) for r in buf.regions]
        x = torch.full((N,), float(dist.get_rank() + 1))
        seen["sum"] = torch.equal(ar(x), torch.full((N,), float(w * (w + 1) // 2)))
    return seen


def test_a_workspace_over_another_is_refused_on_every_rank_naming_both(pool):
    w = 2
    ag_bytes = C.workspace_bytes(N, F32, w, "all_gather")
    for seen in pool.call(overlapping_collectives):
        ar = seen["ar"]
        for case, start in (("same offset", 0), ("part", 128 * 4)):
            kind, message = seen[case]
            assert kind == "ConfigError", (case, seen[case])
            assert "AllGather (view [0, 1], channel 1)" in message and "AllReduce (view [0, 1], channel 0)" in message
            assert _ranges_named(message, (start, start + ag_bytes), ar), message
            assert "rank 0 (and rank 1)" in message  # every rank refused it, each naming the ranks
        assert seen["ag"][0] >= ar[1]  # carve()'s offsets do not overlap, and are taken
        assert [(s, e) for _, s, e in seen["owners"]] == [ar, seen["ag"]]
        assert seen["sum"]  # the refusals left the all-reduce usable


def writer_and_claims() -> dict:
    """The writer's caches, a user's claim and a collective's workspace against each other."""
    w, rank = dist.get_world_size(), dist.get_rank()
    caches = pcp.CacheLayout(num_blocks=1, num_layers=2)
    plan = ss.carve(ar=C.workspace_bytes(N, F32, w), caches=caches.nbytes, mine=C.workspace_bytes(N, F32, w))
    layout = pcp.CacheLayout(num_blocks=1, num_layers=2, base=plan["caches"])
    seen = {"layout": (layout.base, layout.end)}
    with ss.SymmetricBuffer(plan.nbytes, backend="host", channels=3) as buf:
        view = buf.view(list(range(w)))
        writer = pcp.DirectKVWriter(view, layout, channel=0)
        seen["ar over the caches"] = _outcome(lambda: C.AllReduce(view, N, F32, offset=plan["caches"], channel=1))
        seen["claim over the caches"] = _outcome(lambda: buf.claim("scratch", layout.base + 128, 64))
        seen["second writer, same caches"] = _outcome(lambda: pcp.DirectKVWriter(view, layout, channel=2).layout)
        shifted = pcp.CacheLayout(num_blocks=1, num_layers=1, base=plan["caches"] + 128)
        seen["writer of other caches over them"] = _outcome(lambda: pcp.DirectKVWriter(view, shifted, channel=2))
        mine = buf.claim("scratch", plan["mine"], 256)
        seen["claim"] = (mine.owner, mine.start, mine.stop)
        seen["ar over the claim"] = _outcome(lambda: C.AllReduce(view, N, F32, offset=plan["mine"], channel=1))
        seen["claim past the end"] = _outcome(lambda: buf.claim("far", plan.nbytes, 16))
        seen["claims that differ"] = _outcome(lambda: buf.claim("x", 0 if rank == 0 else 128, 64))
        buf.release(mine)
        seen["claim after release"] = _outcome(lambda: buf.claim("again", plan["mine"], 256).owner)
        del writer
    return seen


def test_the_writers_caches_and_a_users_claim_are_owned_like_workspaces(pool):
    for seen in pool.call(writer_and_claims):
        lo, hi = seen["layout"]
        for case in ("ar over the caches", "claim over the caches", "writer of other caches over them"):
            kind, message = seen[case]
            assert kind == "ConfigError" and "DirectKVWriter (view [0, 1]) caches" in message, (case, seen[case])
            assert f"[{lo}, " in message, message  # the caches' range, from their base
        assert "the region 'scratch'" in seen["claim over the caches"][1]
        assert seen["second writer, same caches"][0] == "ok"  # writers of these caches on this view share them
        owner, start, stop = seen["claim"]
        assert owner == "the region 'scratch'" and stop - start == 256
        kind, message = seen["ar over the claim"]
        assert kind == "ConfigError" and "the region 'scratch'" in message and f"[{start}, {stop})" in message
        assert seen["claim past the end"][0] == "BoundsError"
        assert seen["claims that differ"][0] == "ConfigError" and "offset differs" in seen["claims that differ"][1]
        assert seen["claim after release"] == ("ok", "the region 'again'")


# ---------------------------------------------------------------------------- the one sharing
def shared_workspace(steps: int) -> dict:
    """Two all-reduces of one layout at one offset on one channel, called in turn with random
    delays on one rank; then the claims that the rule refuses, and a collected owner's bytes."""
    w, rank = dist.get_world_size(), dist.get_rank()
    nbytes = C.workspace_bytes(2 * N, F32, w)
    seen = {"sums": []}
    with ss.SymmetricBuffer(2 * nbytes, backend="host", channels=3) as buf:
        view = buf.view(list(range(w)))
        first = C.AllReduce(view, N, F32, offset=0, channel=0)
        second = C.AllReduce(view, N, F32, offset=0, channel=0)
        delay = random.Random(7)
        for step in range(steps):
            if rank == 1:
                time.sleep(delay.uniform(0, 0.01))
            ar = (first, second)[step % 2]
            x = torch.arange(N, dtype=F32) * (rank + 1) + step
            want = sum(torch.arange(N, dtype=F32) * (r + 1) + step for r in range(w))  # plain torch, member order
            got = ar(x)
            if not torch.equal(got, want):
                seen["sums"].append((step, first_difference(got, want)))  # (step, (elements that differ, first))
        seen["other channel"] = _outcome(lambda: C.AllReduce(view, N, F32, offset=0, channel=1))
        seen["other layout"] = _outcome(lambda: C.AllReduce(view, 2 * N, F32, offset=0, channel=0))
        other_view = buf.view(list(range(w)))  # the same ranks, cells of its own
        seen["other view"] = _outcome(lambda: C.AllReduce(other_view, N, F32, offset=0, channel=0))
        del first, second, ar  # collected: their bytes are free again
        seen["after they are gone"] = _outcome(lambda: C.AllReduce(view, 2 * N, F32, offset=0, channel=1).max_numel)
    return seen


def test_collectives_of_one_layout_on_one_channel_share_a_workspace_and_nothing_else_does(pool):
    for seen in pool.call(shared_workspace, 40):
        assert seen["sums"] == [], f"steps whose sum differs from torch's: {seen['sums']}"
        for case in ("other channel", "other layout", "other view"):
            kind, message = seen[case]
            assert kind == "ConfigError" and message.count("AllReduce (view [0, 1], channel") == 2, (case, seen[case])
        assert seen["after they are gone"] == ("ok", 2 * N)


# ---------------------------------------------------------------------------- close()
def each_consumer_closed_then_another() -> dict:
    """On one buffer, over the same bytes from offset 0, in turn: the writer, a dispatcher, an
    all-reduce, each made while the one before it still holds the bytes (refused), then made again
    right after that one's close(); each takes one call, is closed, and is called again."""
    w, rank = dist.get_world_size(), dist.get_rank()
    layout = pcp.CacheLayout(num_blocks=1, num_layers=1)
    nbytes = max(layout.nbytes, moe.buffer_bytes(2 * w, 4, 32, torch.bfloat16, 2, w), C.workspace_bytes(N, F32, w))
    seen = {}
    with ss.SymmetricBuffer(nbytes, backend="host", channels=3) as buf:
        view = buf.view(list(range(w)))

        def writer():
            return pcp.DirectKVWriter(view, layout, channel=0, timeout_s=20)

        def dispatcher():
            return moe.Dispatcher(view, 2 * w, 4, 32, torch.bfloat16, 2, timeout_s=20)

        def all_reduce():
            return C.AllReduce(view, N, F32, channel=1, timeout_s=20)

        def write(kv):
            rows = (torch.ones(2, n, dtype=torch.bfloat16) for n in (512, 64, 128))
            kv.write(0, *rows, kv.prepare(torch.arange(2) + 2 * rank))
            return "written"

        def dispatch(d):
            return d.dispatch(torch.ones(4, 32, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64))[1].tolist()

        def reduce(ar):
            return ar(torch.full((N,), float(rank + 1))).tolist()[:2]

        steps = [("writer", writer, write), ("dispatcher", dispatcher, dispatch), ("all-reduce", all_reduce, reduce)]
        held = None
        for name, make, call in steps:
            if held is not None:
                seen[f"{name} over the {held[0]}"] = _outcome(lambda: type(make()).__name__)  # noqa: B023 - called at once
                held[1].close()
            obj = make()
            seen[name] = _outcome(lambda: call(obj))  # noqa: B023 - called at once
            held = (name, obj)
        held[1].close()
        seen["all-reduce after close()"] = _outcome(lambda: call(held[1]))
    return seen


def test_every_consumer_s_close_frees_its_bytes_for_another_at_once(pool):
    for rank, seen in enumerate(pool.call(each_consumer_closed_then_another)):
        for case in ("dispatcher over the writer", "all-reduce over the dispatcher"):
            kind, message = seen[case]
            assert kind == "ConfigError" and "overlaps" in message, (rank, case, seen[case])
        assert seen["writer"] == ("ok", "written"), (rank, seen["writer"])
        # every token of both members goes to expert 0 (rank 0's first): 8 rows there, none elsewhere
        assert seen["dispatcher"] == ("ok", [8, 0] if rank == 0 else [0, 0]), (rank, seen["dispatcher"])
        assert seen["all-reduce"] == ("ok", [3.0, 3.0]), (rank, seen["all-reduce"])
        kind, message = seen["all-reduce after close()"]
        assert kind == "ClosedError" and "used after close()" in message, (rank, seen["all-reduce after close()"])
