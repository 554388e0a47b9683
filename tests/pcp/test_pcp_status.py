"""The writer's status word says a member refused a write before the host settles it (both routes).

The last member writes layer 0 with a float32 ``kv_c`` while the others write their rows. With the
host's settle after each write held back (on the host backend a write settles at once, as
``synchronize()`` does on a GPU), each member reads ``writer.status`` the way a runtime reads it
beside its sampled tokens: 1 on the members whose write returned (a member refused), 0 on the
refusing member (its own write raised ``InputError`` at once). Then ``synchronize()`` raises
``PeerRefused`` naming the last member on the others, the word reads 0 again, and the next write
leaves it 0. On the all-gather route the word comes from the gathered blocks' header rows; the
bite: with that step taken out, the word stays 0 and the test fails.
"""

import helpers
import pytest
import torch.distributed as dist
from oracles import Cache, poisoned_case

import symmsync as ss
from symmsync import pcp
from symmsync.pcp.gathered import GatheredWrites

T, BLOCK = 12, 64


def status_around_a_refused_write(route, variant=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = world - 1
    cache = Cache(1, 2, BLOCK)
    buf = ss.SymmetricBuffer(cache.end, backend="host")
    writer = pcp.DirectKVWriter(buf.view(list(range(world))), cache.layout, route=route, timeout_s=60)
    split = pcp.pcp_split(T, world)
    _, _, _, _, good = poisoned_case(writer, buf, cache, split, rank, 7, T)
    layer, kv, pe, ix, batch = good
    out = {"before": int(writer.status)}
    held = helpers.replaced(
        pcp.DirectKVWriter, settle=lambda self, synchronize=False: None, _raise_refusals=lambda self: None
    )
    unnoted = helpers.replaced(GatheredWrites, _note_refused=lambda self, gathered: None)
    with held, unnoted if variant == "unnoted" else helpers.replaced(GatheredWrites):
        out["write"] = helpers.raised(writer.write, layer, kv.float() if rank == bad else kv, pe, ix, batch)[0]
        out["held"] = int(writer.status)
    out["settled"] = helpers.raised(writer.synchronize)[:3:2]
    out["after"] = int(writer.status)
    writer.write(1, kv, pe, ix, batch)
    out["next"] = int(writer.status)
    buf.close()
    return out


@pytest.mark.parametrize("world, route", [(2, "direct"), (3, "allgather"), (2, "allgather")])
def test_the_status_word_says_a_member_refused_before_the_host_settles(world, route, host_ranks):
    results = host_ranks(status_around_a_refused_write, world, route)
    bad = world - 1
    assert results[bad] == {
        "before": 0, "write": "InputError", "held": 0, "settled": ("returned", None), "after": 0, "next": 0,
    }  # fmt: skip
    for r in range(bad):
        assert results[r] == {
            "before": 0, "write": "returned", "held": 1, "settled": ("PeerRefused", bad), "after": 0, "next": 0,
        }, (r, results[r])  # fmt: skip


def test_the_gathered_status_word_bites(host_ranks):
    """Without the gathered header rows setting it, the word stays 0: the test above fails."""
    results = host_ranks(status_around_a_refused_write, 2, "allgather", "unnoted")
    assert results[0]["held"] == 0 and results[0]["settled"] == ("PeerRefused", 1), results[0]
