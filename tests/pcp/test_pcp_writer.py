"""The PCP direct-KV writer: the byte oracle, the fence it tests, properties, bad input.

The byte oracle (tests/oracles.py): each rank reads its replica's raw bytes right after
``write()`` returns, with one peer late (no barrier before the check: the writer's own
fence must have made the peer's rows visible), and compares them with a cache built with
plain torch from the whole prompt and the format rules, at offsets written out as numbers
from the published layout; every byte outside the written regions keeps its poison. The
all-gather route's bytes are a cross-check (the same kernel). The mutation tests remove
the wait of the fused tail and of the separate fence and show the same oracle failing.
It runs on the host backend, and on 2 GPUs where they exist (the ``backend`` fixture);
the rest runs on the host backend.
"""

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import WAITS, Cache, assert_byte_oracle, byte_oracle, byte_oracle_without, first_difference, prompt

import symmsync as ss
from symmsync import pcp
from symmsync.testing import run

GUARD = 0xA5
BLOCK = 64


# ---------------------------------------------------------------------- pure helpers
def test_split_gives_rank_r_chunks_r_and_2p_minus_1_minus_r_padded():
    s = pcp.pcp_split(10, 2)  # 4 chunks of 3: [0,3) [3,6) [6,9) [9,10)
    assert s.chunk == 3 and s.tokens_per_rank == 6
    assert s.token_index.tolist() == [[0, 1, 2, 9, -1, -1], [3, 4, 5, 6, 7, 8]]
    slots = torch.arange(100, 110)
    assert s.local_slots(slots, 0).tolist() == [100, 101, 102, 109, -1, -1]
    assert s.gathered_slots(slots).tolist() == [100, 101, 102, 109, -1, -1, 103, 104, 105, 106, 107, 108]


@pytest.mark.parametrize("tokens,p", [(0, 2), (1, 2), (1, 4), (7, 4), (130, 2), (1000, 4)])
def test_split_covers_every_token_once(tokens, p):
    s = pcp.pcp_split(tokens, p)
    idx = s.token_index.reshape(-1)
    assert sorted(idx[idx >= 0].tolist()) == list(range(tokens))
    assert s.token_index.shape == (p, s.tokens_per_rank)
    x = torch.arange(tokens, dtype=torch.float32)[:, None]
    rows = torch.cat([s.local_rows(x, r) for r in range(p)])
    assert torch.equal(rows[idx >= 0, 0], idx[idx >= 0].float())


def test_layout_offsets_of_every_field():
    lay = pcp.CacheLayout(num_blocks=3, num_layers=2, block_size=64, base=256)
    m = lay.main
    assert (m.TOKEN_BYTES, m.NOPE_OFFSET, m.SCALES_OFFSET, m.ROPE_OFFSET) == (656, 0, 512, 528)
    assert m.token_offset(5) == 5 * 656
    ix = lay.indexer
    assert ix.block_bytes == 64 * 132
    assert ix.value_offset(64 + 3) == 64 * 132 + 3 * 128
    assert ix.scale_offset(64 + 3) == 64 * 132 + 64 * 128 + 3 * 4
    assert lay.main_bytes == (3 * 64 * 656 + 127) // 128 * 128
    assert lay.main_offset(1) == 256 + lay.layer_bytes and lay.indexer_offset(0) == 256 + lay.main_bytes
    assert lay.end == 256 + 2 * lay.layer_bytes
    with pytest.raises(ss.BoundsError, match="layer 2 is out of range"):
        lay.main_offset(2)
    with pytest.raises(ss.ConfigError, match="layer must be an int"):
        lay.indexer_offset(True)  # a bool is not a layer
    with pytest.raises(ss.ConfigError, match="multiple of 128"):
        pcp.CacheLayout(num_blocks=1, base=100)


def test_the_oracle_places_a_token_by_the_published_numbers():
    # The byte oracle's own geometry (tests/oracles.py), for the PCP2 test's cache: 4 blocks of 64
    # tokens, 656 + 132 bytes each, per layer the main region then the indexer region.
    c = Cache(num_blocks=4, num_layers=2, base=128)
    assert (c.main_bytes, c.layer_bytes, c.layer_at(1), c.end) == (167936, 201728, 201856, 403584)
    kv, pe, ix, _ = prompt(5, 1, 1)
    want = c.expected_layer(kv, pe, ix, torch.tensor([70]), fill=0)  # slot 70: block 1, offset 6
    main = 70 * 656
    values = 167936 + 1 * 64 * 132 + 6 * 128
    scale = 167936 + 1 * 64 * 132 + 64 * 128 + 6 * 4
    assert torch.equal(want[main + 528 : main + 656], pe[0].view(torch.uint8))  # RoPE: copied
    assert want[main : main + 528].any() and want[values : values + 128].any() and want[scale : scale + 4].any()
    written = torch.zeros_like(want, dtype=torch.bool)
    for at, n in ((main, 656), (values, 128), (scale, 4)):
        written[at : at + n] = True
    assert not want[~written].any()  # nothing else


def test_split_rank_outside_the_group_is_a_bounds_error():
    s = pcp.pcp_split(10, 2)
    with pytest.raises(ss.BoundsError, match="rank 2 is out of range"):
        s.local_slots(torch.arange(10), 2)
    with pytest.raises(ss.ConfigError, match="rank must be an int"):
        s.local_rows(torch.zeros(10), True)


# ---------------------------------------------------------------------- the byte oracle
BYTE_ORACLE = {"host": (150, 2, 11), "cuda": (1000, 3, 5)}  # tokens, layers, seed


def test_pcp2_every_replica_matches_torch_right_after_write_with_a_peer_late(backend, host_ranks):
    tokens, layers, seed = BYTE_ORACLE[backend]
    if backend == "host":
        results = host_ranks(byte_oracle, 2, 1, tokens, layers, seed, backend, timeout_s=600)
    else:
        results = run(byte_oracle, 2, 1, tokens, layers, seed, backend, backend=backend, timeout_s=600)
    assert_byte_oracle(results, layers)


@pytest.mark.parametrize("tp", [1, 2], ids=["pcp4", "tp2xpcp2"])
def test_at_world_4_every_replica_matches_torch_right_after_write_with_a_peer_late(tp, host_ranks):
    # On 4 GPUs: tests/gpu/test_gpu_four.py.
    assert_byte_oracle(host_ranks(byte_oracle, 4, tp, 150, 2, 11, timeout_s=600), 2)


@pytest.mark.parametrize("mechanism", sorted(WAITS))
def test_without_its_fence_wait_a_route_fails_the_byte_oracle(mechanism):
    """The oracle tests the fence: with the wait of the fused tail (grid_fence) or of the
    separate fence launch replaced by one that returns at once (in the rank processes),
    rank 0 reads its replica before the late rank 1 wrote into it. The same route passes
    with the wait; and after a barrier the whole buffer is right either way: a check made
    only after a barrier, as this oracle's was before, does not test the fence."""
    _, _, route = WAITS[mechanism]
    key = f"{route[0]}{'-fused' if route[1] else ''}"
    results = run(byte_oracle_without, 2, mechanism, 64, 1, 3, timeout_s=300)
    for intact, removed in results:
        assert intact[key] == [(0, [])] and intact["whole_buffer"] == (0, []), intact
        assert removed["whole_buffer"] == (0, []), removed
    removed = results[0][1][key][0]  # rank 0 checks layer 0 while rank 1 sleeps
    assert removed[0] > 0, results[0]


# ---------------------------------------------------------------------- properties
def one_example(tokens, num_layers, pad, seed):
    """Direct route vs torch for one prompt; returns per-layer equality on this rank, of the
    raw bytes right after each write (the rows, the padding and the unwritten slots)."""
    world = dist.get_world_size()
    cache = Cache(num_blocks=max(1, -(-tokens // BLOCK)) + 1, num_layers=num_layers, base=128)
    buf = ss.SymmetricBuffer(cache.end + 128, backend="host")
    buf.tensor(0, (buf.nbytes,), torch.uint8).fill_(GUARD)
    view = buf.view(list(range(world)))
    dist.barrier()  # every replica is poisoned before anyone writes into it
    writer = pcp.DirectKVWriter(view, cache.layout, timeout_s=60)
    kv, pe, ix, slots = prompt(seed, tokens, cache.num_slots)
    if pad:  # some prompt tokens have no cache slot (padding inside the prompt)
        g = torch.Generator().manual_seed(seed + 1)
        slots[torch.rand(tokens, generator=g) < pad] = -1
    split = pcp.pcp_split(tokens, world)
    batch = writer.prepare(split.local_slots(slots, buf.rank))
    diffs = []  # per layer: (bytes that differ from torch's cache, the first offsets)
    for layer in range(num_layers):
        rows = [(split.local_rows(t, buf.rank).float() + layer).to(torch.bfloat16).contiguous() for t in (kv, pe, ix)]
        writer.write(layer, *rows, batch)
        want = cache.expected_layer(*[(t.float() + layer).to(torch.bfloat16) for t in (kv, pe, ix)], slots, GUARD)
        diffs.append(first_difference(cache.raw_layer(buf, layer), want))
    buf.close()
    return diffs


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    tokens=st.one_of(st.sampled_from([0, 1, 63, 64, 65]), st.integers(0, 300)),
    num_layers=st.integers(1, 3),
    pad=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_direct_writes_match_torch_for_any_token_count_padding_and_layers(host_ranks, tokens, num_layers, pad, seed):
    for rank, diffs in enumerate(host_ranks(one_example, 2, tokens, num_layers, pad, seed)):
        assert diffs == [(0, [])] * num_layers, f"rank {rank}: per layer, (bytes that differ, first offsets): {diffs}"


# ---------------------------------------------------------------------- bad input
def bad_inputs():
    layout = pcp.CacheLayout(num_blocks=2, num_layers=2, base=0)
    buf = ss.SymmetricBuffer(layout.end, backend="host")
    view = buf.view([0, 1])
    writer = pcp.DirectKVWriter(view, layout, timeout_s=30, debug=True)
    r = buf.rank
    T = 8
    ok_slots = torch.arange(T) + T * r
    batch = writer.prepare(ok_slots)
    kv = torch.zeros(T, 512, dtype=torch.bfloat16)
    pe = torch.zeros(T, 64, dtype=torch.bfloat16)
    ix = torch.zeros(T, 128, dtype=torch.bfloat16)
    buf.tensor(0, (layout.end,), torch.uint8).fill_(GUARD)
    errors = {}
    cases = {
        "layer": lambda: writer.write(2, kv, pe, ix, batch),
        "dtype": lambda: writer.write(0, kv.float(), pe, ix, batch),
        "shape": lambda: writer.write(0, kv[:, :256].contiguous(), pe, ix, batch),
        "rows": lambda: writer.write(0, kv[:4].contiguous(), pe[:4].contiguous(), ix[:4].contiguous(), batch),
        "noncontiguous": lambda: writer.write(0, torch.zeros(512, T, dtype=torch.bfloat16).t(), pe, ix, batch),
        "batch": lambda: writer.write(0, kv, pe, ix, ok_slots),
        "meta": lambda: writer.write(0, kv.to("meta"), pe, ix, batch),  # a tensor without memory
        "bool_layer": lambda: writer.write(True, kv, pe, ix, batch),
        "grad": lambda: writer.write(0, kv, pe, ix.clone().requires_grad_(), batch),  # grad mode is on here
    }
    for name, fn in cases.items():
        try:
            fn()
        except ss.ConfigError as e:
            errors[name] = (type(e).__name__, str(e))
    collective = {}
    for name, slots in {
        "range": ok_slots + (1000 if r == 1 else 0),
        "below": ok_slots - (100 if r == 0 else 0),
        "length": torch.arange(T + (1 if r == 1 else 0)),
        "dtype": ok_slots.float() if r == 0 else ok_slots,
        "duplicate": torch.arange(T),  # debug mode: both ranks claim slots 0..7
    }.items():
        try:
            writer.prepare(slots)
        except ss.InputError as e:
            collective[name] = str(e)
    # The layout's own check of a layer raises what write() raises.
    try:
        layout.main_offset(2)
    except ss.ConfigError as e:
        errors["layout_layer"] = (type(e).__name__, str(e))
    untouched = bool((buf.tensor(0, (layout.end,), torch.uint8) == GUARD).all())
    buf.close()
    return errors, collective, untouched


def test_bad_input_raises_before_any_byte_is_written(host_ranks):
    for rank, (errors, collective, untouched) in enumerate(host_ranks(bad_inputs, 2)):
        inputs = {"dtype", "shape", "rows", "noncontiguous", "batch", "meta", "grad"}
        assert set(errors) == inputs | {"layer", "bool_layer", "layout_layer"}, errors
        assert {errors[k][0] for k in inputs} == {"InputError"}, errors
        for name, (_, msg) in errors.items():
            assert msg.startswith("CacheLayout: " if name == "layout_layer" else f"rank {rank}: DirectKVWriter.write: ")
        # A layer outside the cache: the same error from the layout and from write().
        assert errors["layer"][0] == errors["layout_layer"][0] == "BoundsError"
        assert all("layer 2 is out of range" in errors[k][1] for k in ("layer", "layout_layer"))
        assert errors["bool_layer"][0] == "ConfigError" and "must be an int" in errors["bool_layer"][1]
        assert "meta" in errors["meta"][1]
        assert "bfloat16" in errors["dtype"][1] and "contiguous" in errors["noncontiguous"][1]
        assert "(8, 512)" in errors["shape"][1]
        assert "indexer_k requires grad and grad mode is on" in errors["grad"][1] and "no_grad" in errors["grad"][1]
        # Slot-mapping problems are agreed in prepare(): every rank raises, naming the rank.
        assert set(collective) == {"range", "below", "length", "dtype", "duplicate"}, collective
        assert collective["range"].startswith("DirectKVWriter.prepare: rank 1: ")
        assert "outside [-1, 128)" in collective["range"]
        assert collective["below"].startswith("DirectKVWriter.prepare: rank 0: ")
        assert "equal row counts" in collective["length"] and "rank 1: 9" in collective["length"]
        assert "rank 0" in collective["dtype"] and "int32 or int64" in collective["dtype"]
        assert "slot 0 is written by rank 0 and rank 1" in collective["duplicate"]
        assert untouched


def mixed_routes():
    layout = pcp.CacheLayout(num_blocks=1, num_layers=1)
    buf = ss.SymmetricBuffer(layout.end, backend="host")
    route = "direct" if buf.rank == 0 else "allgather"
    try:
        pcp.DirectKVWriter(buf.view([0, 1]), layout, route=route)
    except ss.ConfigError as e:
        return str(e)
    finally:
        buf.close()


def test_ranks_that_pick_different_routes_all_raise(host_ranks):
    for msg in host_ranks(mixed_routes, 2):
        # The direct route fuses its fence by default: the route is named with it.
        assert msg and "same route" in msg and "rank 0: 'direct fused'" in msg and "rank 1: 'allgather'" in msg


# ---------------------------------------------------------------------- a bad write on one member
# tests/pcp/test_pcp_refusals.py: it fails that write on every member, and nothing else.


# ---------------------------------------------------------------------- agreement: every rank raises the same
def bad_channel_on_rank_1():
    layout = pcp.CacheLayout(num_blocks=1, num_layers=1)
    buf = ss.SymmetricBuffer(layout.end, backend="host", channels=2)
    try:
        pcp.DirectKVWriter(buf.view([0, 1]), layout, channel=5 if buf.rank == 1 else 0)
    except ss.ConfigError as e:
        return type(e).__name__, str(e)
    finally:
        buf.close()


def test_a_channel_outside_the_view_raises_the_same_bounds_error_on_every_rank(host_ranks):
    results = host_ranks(bad_channel_on_rank_1, 2)
    assert results[0] == results[1], results
    kind, msg = results[0]
    assert kind == "BoundsError" and msg.startswith("DirectKVWriter: rank 1: ") and "channel 5" in msg, msg


def peer_dies_before_prepare():
    layout = pcp.CacheLayout(num_blocks=1, num_layers=1)
    buf = ss.SymmetricBuffer(layout.end, backend="host")
    writer = pcp.DirectKVWriter(buf.view([0, 1]), layout, timeout_s=30)
    if buf.rank == 1:
        os._exit(0)
    try:
        writer.prepare(torch.arange(4))
    except ss.SymmSyncError as e:
        return type(e).__name__, str(e)
    return "no error"


def test_a_peer_that_died_makes_prepare_raise_backend_error():
    results = run(peer_dies_before_prepare, 2, may_die=[1], timeout_s=120)
    kind, msg = results[0]
    assert kind == "BackendError" and "rank 0" in msg and "died or left" in msg, results[0]
