"""The PCP direct-KV writer on the host backend: the byte oracle, properties, bad input.

The byte oracle: after a layer's fence, every replica's cache is byte-identical to
what the all-gather + insert route produces, and to a cache built with plain torch
from the whole prompt and the format rules (tests/test_pcp_formats.py); guard bytes
around the backing stay untouched.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pcp_formats import oracle_cache

import symmsync as ss
from symmsync import pcp
from symmsync.testing import RankPool, run

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
    with pytest.raises(ss.ConfigError):
        lay.main_offset(2)
    with pytest.raises(ss.ConfigError):
        pcp.CacheLayout(num_blocks=1, base=100)


# ---------------------------------------------------------------------- reference cache
def reference_cache(layout, kv_c, k_pe, idx_k, slots):
    """The cache bytes of a whole prompt in the layout's formats: [main KV] and [indexer K].

    Built with plain torch from the format rules (tests/test_pcp_formats.py), sharing no
    code with the writer.
    """
    return oracle_cache(layout, kv_c, k_pe, idx_k, slots)


def prompt(seed, tokens, num_slots, special=False):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, 512, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g) * 3)
    pe = torch.randn(tokens, 64, generator=g)
    ix = torch.randn(tokens, 128, generator=g) * 10
    if special and tokens >= 4:
        kv[0] = 0.0  # a zero row: the scale floors
        kv[1, :128] = -0.0
        kv[2] = torch.randn(512, generator=g) * 1e-39  # bf16 subnormals
        kv[3, 5] = 1.0e38  # large values (finite also after the tests scale a layer by up to 3)
        ix[0] = 0.0
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    return kv.to(torch.bfloat16), pe.to(torch.bfloat16), ix.to(torch.bfloat16), slots


# ---------------------------------------------------------------------- the byte oracle
ROUTES = [("direct", False), ("direct", True), ("allgather", False)]


def byte_oracle(tp, tokens, num_layers, seed, backend="host"):
    world = dist.get_world_size()
    p = world // tp
    layout0 = pcp.CacheLayout(num_blocks=max(1, -(-tokens // BLOCK)) + 1, num_layers=num_layers, base=128)
    span = layout0.nbytes + 256  # each route's layout, with guard bytes between them
    layouts = [pcp.CacheLayout(layout0.num_blocks, num_layers, BLOCK, base=128 + i * span) for i in range(3)]
    buf = ss.SymmetricBuffer(layouts[-1].end + 128, backend=backend, channels=2)
    buf.tensor(0, (buf.nbytes,), torch.uint8).fill_(GUARD)
    for lay in layouts:
        for layer in range(num_layers):
            lay.layer_backing(buf, layer).zero_()
    view = ss.pcp_view(buf, tp=tp)
    ranks_by_group = [[k * tp + t for k in range(p)] for t in range(tp)]
    group, _ = dist.new_subgroups_by_enumeration(ranks_by_group)
    dist.barrier()
    kv, pe, ix, slots = prompt(seed + view.ranks[0], tokens, layout0.num_slots, special=True)
    split = pcp.pcp_split(tokens, p)
    me = view.local_index
    local = [split.local_rows(t, me).contiguous().to(buf.device) for t in (kv, pe, ix)]
    result = {}
    for i, (route, fused) in enumerate(ROUTES):
        writer = pcp.DirectKVWriter(
            view, layouts[i], route=route, fused=fused, group=group, channel=i % 2, timeout_s=60
        )
        batch = writer.prepare(split.local_slots(slots, me).to(buf.device))
        for layer in range(num_layers):
            # Different inputs per layer, so a layer written into another layer's place shows.
            writer.write(layer, *[(t.float() * (layer + 1)).to(torch.bfloat16) for t in local], batch)
    if backend == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    for layer in range(num_layers):
        want = reference_cache(layouts[0], *[(t.float() * (layer + 1)).to(torch.bfloat16) for t in (kv, pe, ix)], slots)
        for i, (route, fused) in enumerate(ROUTES):
            got = (layouts[i].main_kv(buf, layer).cpu(), layouts[i].indexer_k(buf, layer).cpu())
            base = (layouts[2].main_kv(buf, layer).cpu(), layouts[2].indexer_k(buf, layer).cpu())
            key = f"{route}{'-fused' if fused else ''}"
            result.setdefault(key, []).append(
                (
                    torch.equal(got[0], want[0]),
                    torch.equal(got[1], want[1]),
                    torch.equal(got[0], base[0]),
                    torch.equal(got[1], base[1]),
                )
            )
    mem = buf.tensor(0, (buf.nbytes,), torch.uint8).cpu()
    mask = torch.ones(buf.nbytes, dtype=torch.bool)
    for lay in layouts:
        mask[lay.base : lay.end] = False
    result["guards_untouched"] = bool((mem[mask] == GUARD).all())
    result["guard_bytes"] = int(mask.sum())
    buf.close()
    return result


def _assert_oracle(results, num_layers):
    for r in results:
        assert r["guards_untouched"] and r["guard_bytes"] > 0
        for key in ("direct", "direct-fused", "allgather"):
            assert r[key] == [(True, True, True, True)] * num_layers, (key, r[key])


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 1), (4, 2)], ids=["pcp2", "pcp4", "tp2xpcp2"])
def test_every_replica_is_byte_identical_to_allgather_insert_and_to_torch(world, tp):
    _assert_oracle(run(byte_oracle, world, tp, 150, 2, 11, timeout_s=600), 2)


# ---------------------------------------------------------------------- properties
def one_example(tokens, num_layers, pad, seed):
    """Direct route vs torch for one prompt; returns per-layer equality on this rank."""
    world = dist.get_world_size()
    layout = pcp.CacheLayout(num_blocks=max(1, -(-tokens // BLOCK)) + 1, num_layers=num_layers, base=128)
    buf = ss.SymmetricBuffer(layout.end + 128, backend="host")
    view = buf.view(list(range(world)))
    writer = pcp.DirectKVWriter(view, layout, timeout_s=60)
    kv, pe, ix, slots = prompt(seed, tokens, layout.num_slots)
    if pad:  # some prompt tokens have no cache slot (padding inside the prompt)
        g = torch.Generator().manual_seed(seed + 1)
        slots[torch.rand(tokens, generator=g) < pad] = -1
    split = pcp.pcp_split(tokens, world)
    batch = writer.prepare(split.local_slots(slots, buf.rank))
    ok = []
    for layer in range(num_layers):
        rows = [(split.local_rows(t, buf.rank).float() + layer).to(torch.bfloat16).contiguous() for t in (kv, pe, ix)]
        writer.write(layer, *rows, batch)
        want = reference_cache(layout, *[(t.float() + layer).to(torch.bfloat16) for t in (kv, pe, ix)], slots)
        ok.append(
            torch.equal(layout.main_kv(buf, layer), want[0]) and torch.equal(layout.indexer_k(buf, layer), want[1])
        )
    buf.close()
    return ok


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout_s=300) as p:
        yield p


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    tokens=st.one_of(st.sampled_from([0, 1, 63, 64, 65]), st.integers(0, 300)),
    num_layers=st.integers(1, 3),
    pad=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_direct_writes_match_torch_for_any_token_count_padding_and_layers(pool, tokens, num_layers, pad, seed):
    for per_rank in pool.call(one_example, tokens, num_layers, pad, seed):
        assert per_rank == [True] * num_layers


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
    }
    for name, fn in cases.items():
        try:
            fn()
        except ss.InputError as e:
            errors[name] = str(e)
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
    untouched = bool((buf.tensor(0, (layout.end,), torch.uint8) == GUARD).all())
    buf.close()
    return errors, collective, untouched


def test_bad_input_raises_before_any_byte_is_written():
    for errors, collective, untouched in run(bad_inputs, 2):
        assert set(errors) == {"layer", "dtype", "shape", "rows", "noncontiguous", "batch", "meta"}, errors
        assert "meta" in errors["meta"]
        assert "layer 2 is out of range" in errors["layer"]
        assert "bfloat16" in errors["dtype"] and "contiguous" in errors["noncontiguous"]
        assert "(8, 512)" in errors["shape"]
        # Slot-mapping problems are agreed in prepare(): every rank raises, naming the rank.
        assert set(collective) == {"range", "below", "length", "dtype", "duplicate"}, collective
        assert "rank 1" in collective["range"] and "outside [-1, 128)" in collective["range"]
        assert "rank 0" in collective["below"]
        assert "equal row counts" in collective["length"]
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


def test_ranks_that_pick_different_routes_all_raise():
    for msg in run(mixed_routes, 2):
        assert msg and "same route" in msg and "rank 0: direct" in msg and "rank 1: allgather" in msg


# ---------------------------------------------------------------------- a bad write reaches the peers
def bad_write_on_one_rank(fused, bad_rank):
    import time

    layout = pcp.CacheLayout(num_blocks=2, num_layers=2, base=0)
    buf = ss.SymmetricBuffer(layout.end, backend="host")
    view = buf.view([0, 1])
    writer = pcp.DirectKVWriter(view, layout, fused=fused, timeout_s=60)  # a missed abort shows as a minute
    T = 8
    batch = writer.prepare(torch.arange(T) + T * buf.rank)
    kv = torch.zeros(T, 512, dtype=torch.bfloat16)
    pe = torch.zeros(T, 64, dtype=torch.bfloat16)
    ix = torch.zeros(T, 128, dtype=torch.bfloat16)
    writer.write(0, kv, pe, ix, batch)  # one good layer on both ranks
    t0 = time.monotonic()
    try:
        if buf.rank == bad_rank:
            writer.write(1, kv.float(), pe, ix, batch)  # wrong dtype: raises before writing
        else:
            writer.write(1, kv, pe, ix, batch)  # waits in the fence (or the fused tail)
    except ss.SymmSyncError as e:
        out = {"type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
        out["aborted"] = getattr(e, "aborted", None)
        # The writer refuses to go on after it: the fence stays failed (fail closed).
        try:
            writer.write(1, kv, pe, ix, batch)
            out["again"] = "wrote"
        except ss.SymmSyncError as e2:
            out["again"] = type(e2).__name__
        buf.close()
        return out
    buf.close()
    return "no error"


@pytest.mark.parametrize("fused", [False, True], ids=["fence", "fused"])
def test_a_bad_write_on_one_rank_makes_every_peer_raise_naming_it_at_once(fused):
    res = run(bad_write_on_one_rank, 2, fused, 1, timeout_s=120)
    bad, peer = res[1], res[0]
    assert bad["type"] == "InputError" and "bfloat16" in bad["msg"], bad
    assert peer["type"] == "PeerAborted", peer
    assert 1 in peer["aborted"] and "DirectKVWriter.write" in peer["aborted"][1] and "bfloat16" in peer["aborted"][1]
    assert "rank 1" in peer["msg"]
    assert peer["elapsed"] < 1.0, peer  # the fence budget is 60 s
    assert peer["again"] == "PeerAborted"
