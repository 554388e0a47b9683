"""A bad write fails that write on every member, and nothing else (one node; both routes).

The last member makes each kind of bad write of layer 0 while the others write their rows of
it: the bad member raises its error (``InputError``; a layer out of range ``BoundsError``, a
``bool`` layer ``ConfigError``), the others ``PeerRefused`` naming it. Then, per case, the bytes
of every replica are read (the references: tests/oracles.py, plain torch from the format rules,
on a replica poisoned before the case): layer 0 holds the good members' rows and poison where
the bad member's rows would be (nothing of it was written, nothing else corrupted), and layer 1,
written next by every member, holds every member's rows. An all-reduce on the same view (another
channel) still sums at the end. Worlds 2 and 3: the direct route with the fused tail and the
separate fence, and the all-gather route (where a bad layer or batch leaves the bad member's own
replica without the layer: it cannot say where the members' rows go). The bites: with the
call header's check taken out of the direct route's kernels (every call taken as good), or the
all-gather route's record left unposted, the members' writes return as if nothing happened;
with the refused block's header left clear, the members insert its stale rows; each time the
test fails.
"""

import helpers
import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from oracles import Cache, first_difference, poisoned_case

import symmsync as ss
from symmsync import collectives, pcp
from symmsync.language import calls as calls_module
from symmsync.pcp.gathered import GatheredWrites

T = 12  # tokens of the prompt
BLOCK = 64

#: name: (the bad member's write(layer, kv, pe, ix, batch) arguments from the good ones, its error, words)
CASES = {
    "dtype": (lambda a: (a[0], a[1].float(), *a[2:]), "InputError", "bfloat16"),
    "shape": (lambda a: (a[0], a[1][:, :256].contiguous(), *a[2:]), "InputError", "512)"),
    "rows": (lambda a: (a[0], *(t[:2].contiguous() for t in a[1:4]), a[4]), "InputError", "match the batch"),
    "noncontiguous": (lambda a: (a[0], a[1].t().contiguous().t(), *a[2:]), "InputError", "contiguous"),
    "batch": (lambda a: (*a[:4], torch.arange(3)), "InputError", "pass the Batch"),
    "meta": (lambda a: (a[0], a[1].to("meta"), *a[2:]), "InputError", "meta"),
    "grad": (lambda a: (*a[:3], a[3].clone().requires_grad_(), a[4]), "InputError", "requires grad"),
    "layer": (lambda a: (5, *a[1:]), "BoundsError", "layer 5 is out of range"),
    "bool_layer": (lambda a: (True, *a[1:]), "ConfigError", "must be an int"),
}


@triton.jit
def unchecked(calls, me, n, KIND: tl.constexpr, a, b, c, d, refused, SIZE: tl.constexpr):
    """The call header's check that takes every call as good (the bite)."""
    return tl.full((), 0, tl.int64), tl.full((), -1, tl.int64)


#: The cases whose bad argument is the layer or the batch: on the all-gather route the bad member
#: then inserts nothing into its own replica (it cannot say where the members' rows go).
NO_INSERT = ("layer", "bool_layer", "batch")


_stage = GatheredWrites.stage


def unflagged_stage(gathered, batch):
    """A gathered route's staging whose header is a copy, not the word sent: a refused block goes
    out unmarked (the bite of the all-gather route's header)."""
    rows = _stage(gathered, batch)
    batch._header = batch._header.clone()
    gathered.staged = (*gathered.staged[:2], batch._header)
    return rows


def refusals(fused, variant=None, route="direct"):
    """Rank function: what each member's write of each case raised, the differences of its
    replica's layers 0 and 1 from the references after each case, and whether the all-reduce
    on the same view still sums."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = world - 1
    nb = 1
    cache = Cache(nb, 2, BLOCK)
    per = collectives.workspace_bytes(64, torch.float32, world)
    buf = ss.SymmetricBuffer(cache.end + per, backend="host", channels=2)
    view = buf.view(list(range(world)))
    writer = pcp.DirectKVWriter(view, cache.layout, route=route, fused=fused, timeout_s=60)
    ar = collectives.AllReduce(view, 64, torch.float32, offset=cache.end, channel=1, timeout_s=60)
    split = pcp.pcp_split(T, world)
    seen, wrong = {}, []
    swap = {
        None: helpers.replaced(calls_module),
        "unchecked": helpers.replaced(calls_module, check_call=unchecked),
        "unposted": helpers.refusals_posted(False),
        "unflagged": helpers.replaced(GatheredWrites, stage=unflagged_stage),
    }[variant]
    try:
        with swap:
            for i, (name, (change, _, _)) in enumerate(CASES.items()):
                kv, pe, ix, slots, good = poisoned_case(writer, buf, cache, split, rank, 100 + i, T)
                _, *rows, batch = good
                seen[name] = helpers.raised(writer.write, *(change(good) if rank == bad else good))
                try:
                    writer.write(1, *rows, batch)
                except ss.SymmSyncError as e:
                    wrong.append(f"{name}: the next write raised {type(e).__name__}: {str(e)[:300]}")
                    break
                dist.barrier()  # every member's write of both layers is over before the check
                # Layer 0: the good members' rows; the bad member's rows nowhere (poison). Layer 1: all.
                members = [r for r in range(world) if r != bad]
                theirs = [torch.cat([split.local_rows(t, r) for r in members]) for t in (kv, pe, ix)]
                want0 = cache.expected_layer(*theirs, torch.cat([split.local_slots(slots, r) for r in members]))
                if route == "allgather" and rank == bad and name in NO_INSERT:
                    want0 = cache.expected_layer(*theirs, torch.full_like(want0[:0], -1, dtype=torch.int64))
                want1 = cache.expected_layer(kv, pe, ix, slots)
                for layer, want in ((0, want0), (1, want1)):
                    diff = first_difference(cache.raw_layer(buf, layer), want)
                    if diff != (0, []):
                        wrong.append(f"{name}: layer {layer} of this replica differs from the reference: {diff}")
                dist.barrier()  # nobody poisons its replica while a peer still reads it
        summed = bool((ar(torch.full((64,), float(rank + 1))) == world * (world + 1) / 2).all())
    finally:
        buf.close()
    return seen, wrong, summed


def _check(results):
    world = len(results)
    bad = world - 1
    for r, (_, wrong, summed) in enumerate(results):
        assert wrong == [], f"rank {r}: {wrong[:4]}"
        assert summed, f"rank {r}: the all-reduce on the writer's view no longer sums"
    for name, (_, error, words) in CASES.items():
        mine = results[bad][0][name]
        assert mine[0] == error and mine[1].startswith(f"rank {bad}: DirectKVWriter.write: "), (name, mine)
        assert words in mine[1] and "wrote nothing of the layer" in mine[1], (name, mine)
        for r in range(bad):
            theirs = results[r][0][name]
            assert theirs[0] == "PeerRefused" and theirs[2] == bad, (name, r, theirs)
            assert f"rank {bad} refused its write" in theirs[1], (name, r, theirs)


@pytest.mark.parametrize(
    "world, fused, route",
    [(2, True, "direct"), (2, False, "direct"), (3, True, "direct"), (2, False, "allgather"), (3, False, "allgather")],
    ids=["world2-fused", "world2-fence", "world3-fused", "world2-allgather", "world3-allgather"],
)
def test_a_bad_write_fails_that_write_on_every_member_and_nothing_else(world, fused, route, host_ranks):
    _check(host_ranks(refusals, world, fused, None, route, timeout_s=600))


@pytest.mark.parametrize(
    "fused, variant, route",
    [(True, "unchecked", "direct"), (False, "unposted", "allgather")],
    ids=["direct-call-header", "allgather-store-record"],
)
def test_the_refusal_marks_bite(fused, variant, route, host_ranks):
    """Without the news of a refusal (the direct route's call header check, the all-gather route's
    record), the members' writes of a refused layer return: the test above fails."""
    results = host_ranks(refusals, 2, fused, variant, route, timeout_s=600)
    assert {got[0] for got in results[0][0].values()} == {"returned"}, results[0][0]
    with pytest.raises(AssertionError, match="returned"):
        _check(results)


def test_the_all_gather_routes_header_bites(host_ranks):
    """With the refused block sent unmarked, the members insert the bad member's stale rows: the
    byte oracle of the test above fails."""
    results = host_ranks(refusals, 2, False, "unflagged", "allgather", timeout_s=600)
    assert any("layer 0 of this replica differs" in w for w in results[0][1]), results[0][1]
    with pytest.raises(AssertionError, match="layer 0 of this replica differs"):
        _check(results)
