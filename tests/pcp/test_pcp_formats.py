"""Every cache format of the PCP writer, against references written from the format rules.

The references (tests/oracles.py) are plain torch, written from the rules in
docs/pcp.md ("Cache formats"), and share no code with ``symmsync.pcp.quant``. The
writer runs for every combination of formats on every route and slot pattern on 2 GPUs
where they exist (the ``backend`` fixture; tests/gpu/test_gpu_pcp_formats.py checks the
GPU's fp8 conversion itself), and on the host backend (2 ranks, Triton's interpreter) for
a pairwise subset: every value of each axis (main scale, indexer scale, route, slot
pattern) with every value of every other; the whole matrix there is a soak. Every
replica's raw bytes (its rows, padding and untouched slots, at offsets the oracle computes
from the published layout) are compared byte for byte right after ``write()`` returns,
with one peer late and no barrier before the check; at the end every byte of the buffer
outside the written regions must still hold its poison.
"""

import itertools
import time

import pytest
import torch
import torch.distributed as dist
from oracles import (
    F448,
    GUARD_BYTES,
    POISON,
    Cache,
    delayed_writer,
    e4m3,
    first_difference,
    indexer_ref,
    main_ref,
    whole_buffer,
)

import symmsync as ss
from symmsync import pcp
from symmsync.testing import run

FORMATS = list(itertools.product(("pow2", "fp32"), ("ue8m0", "fp32", "mxfp8")))


# ---------------------------------------------------------------------- the inputs
def _bf16_bits(bits) -> torch.Tensor:
    b = torch.as_tensor(bits, dtype=torch.int64)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def _above_448_amax() -> float:
    """A bf16 amax whose fp32 scale ``fl(amax / 448)`` makes ``amax / s`` exceed 448."""
    a = _bf16_bits(torch.arange(0x3F80, 0x4000)).float()  # every bf16 in [1, 2)
    s = a / F448
    hit = (a / s) > 448.0
    assert hit.any()
    return float(a[hit][0])


def special_prompt(tokens: int, seed: int = 0):
    """``(kv_c, k_pe, indexer_k)`` bf16 rows: the edge cases first, then ordinary rows."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, 4, 128, generator=g) * torch.exp(torch.randn(tokens, 4, 1, generator=g) * 3)
    ix = torch.randn(tokens, 128, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g) * 3)
    sign = torch.where(torch.rand(tokens, 512, generator=g) < 0.5, 0x8000, 0)
    rows = {}
    rows["zero"] = (torch.zeros(4, 128), torch.zeros(128))
    # Below every floor: main amax < 448 * 2**-126 and indexer amax < 1e-4.
    rows["below_floors"] = (torch.randn(4, 128, generator=g) * 2e-38, torch.randn(128, generator=g) * 1e-5)
    sub = _bf16_bits(torch.randint(1, 0x80, (512,), generator=g) | sign[0]).float()
    rows["bf16_subnormal"] = (sub.reshape(4, 128), sub[:128])
    signed_zero = torch.tensor([0.0, -0.0] * 64)
    rows["signed_zero"] = (
        torch.stack([-torch.zeros(128), signed_zero, torch.cat([torch.tensor([1.0]), -torch.zeros(127)]), signed_zero]),
        -torch.zeros(128),
    )
    # Exact ties after the division: with amax = 448 * 2**k every scale is 2**k (all formats),
    # and these values sit halfway between two e4m3 codes.
    ties = torch.tensor([448.0, 1.0625, -1.1875, 17.0, 19.0, 272.0, -304.0, 1.5 * 2.0**-9, 2.5 * 2.0**-9, -448.0])
    tie_tile = torch.cat([ties, ties.new_zeros(128 - ties.numel())])
    rows["ties"] = (torch.stack([tie_tile * 2.0 ** (10 * j - 15) for j in range(4)]), tie_tile * 2.0**-3)
    a = _above_448_amax()
    rows["x_over_s_448"] = (
        torch.stack([torch.full((128,), a), torch.full((128,), -a), tie_tile, torch.full((128,), 448.0)]),
        torch.full((128,), 448.0),
    )
    big = torch.tensor([3.3895e38, -3.0e38, 1.0e30, -1.0] * 32)
    rows["large"] = (torch.stack([big, -big, big * 1e-10, big.flip(0)]), big)
    for i, v in enumerate(rows.values()):
        if i < tokens:
            kv[i], ix[i] = v
    pe = _bf16_bits(torch.randint(0, 1 << 16, (tokens, 64), generator=g))  # any bits, NaNs too: copied
    return kv.reshape(tokens, 512).to(torch.bfloat16), pe, ix.to(torch.bfloat16)


# ---------------------------------------------------------------------- the references by hand
def test_references_follow_the_rules_by_hand():
    assert e4m3(torch.tensor([448.0, 464.0, 465.0, 1e30, -464.0, 1.0625, 17.0, -0.0])).tolist() == [
        0x7E,
        0x7E,
        0x7E,
        0x7E,
        0xFE,
        0x38,  # the tie 1.0625 goes to the even 1.0
        0x58,  # 17 goes to the even 16
        0x80,
    ]
    kv = torch.ones(1, 512, dtype=torch.bfloat16)
    kv[0, 128:256] = 0.0
    pe = torch.zeros(1, 64, dtype=torch.bfloat16)
    pow2 = main_ref(kv, pe, "pow2")
    # amax 1: 1/448 -> scale 2**-8, 1 / 2**-8 = 256 (code 0x78); zero tile: floor 1e-4 -> 2**-13.
    assert pow2[0, 512:528].view(torch.float32).tolist() == [2.0**-8, 2.0**-13, 2.0**-8, 2.0**-8]
    assert set(pow2[0, :128].tolist()) == {0x78} and set(pow2[0, 128:256].tolist()) == {0}
    legacy = main_ref(kv, pe, "fp32")
    assert legacy[0, 512:528].view(torch.float32).tolist()[:2] == [float(torch.tensor(1.0) / F448), 2.0**-126]
    assert set(legacy[0, :128].tolist()) == {0x7E}
    ix = torch.full((1, 128), 3.0, dtype=torch.bfloat16)
    c, f = indexer_ref(ix, "ue8m0")
    assert f.view(torch.float32).item() == 2.0**-7 and set(c[0].tolist()) == {0x7C}  # 3 / 2**-7 = 384
    c, f = indexer_ref(ix, "mxfp8")
    assert f[0].tolist() == [120] * 4  # 2**-7: biased exponent 127 - 7
    c, f = indexer_ref(ix, "fp32")
    assert f.view(torch.float32).item() == float(torch.tensor(3.0) / F448) and set(c[0].tolist()) == {0x7E}
    c, f = indexer_ref(torch.zeros(1, 128, dtype=torch.bfloat16), "ue8m0")
    assert f.view(torch.float32).item() == 2.0**-22  # the floor applies to amax: 1e-4 / 448 -> 2**-22


def test_the_formats_give_different_bytes_on_ordinary_data():
    kv, pe, ix = special_prompt(32, seed=3)
    a, b = main_ref(kv[10:], pe[10:], "pow2"), main_ref(kv[10:], pe[10:], "fp32")
    assert (a[:, :512] != b[:, :512]).float().mean() > 0.3  # the oracle tells the formats apart
    assert (indexer_ref(ix, "ue8m0")[0] != indexer_ref(ix, "fp32")[0]).any()
    assert not torch.equal(indexer_ref(ix, "ue8m0")[1], indexer_ref(ix, "mxfp8")[1])


@pytest.mark.parametrize(
    "kw", [{"main_scale": "e8m0"}, {"indexer_scale": "pow2"}, {"main_scale": None}, {"indexer_scale": 0}]
)
def test_unknown_formats_raise_config_error(kw):
    with pytest.raises(ss.ConfigError, match="must be one of"):
        pcp.CacheLayout(num_blocks=1, **kw)


def test_layout_defaults_are_the_current_formats():
    lay = pcp.CacheLayout(num_blocks=1)
    assert (lay.main_scale, lay.indexer_scale) == ("pow2", "ue8m0")


# ---------------------------------------------------------------------- the writer, every format
# A route and how its kernel runs: by default a persistent grid whose programs load their
# next work item early; "spread" gives each destination its own programs, "plain" one
# program per work item, and "fence" a writer kernel then a fence launch (the default
# fuses the fence into the writer's tail).
ROUTES = ("direct", "direct-spread", "direct-plain", "direct-fence", "allgather")
OPTIONS = {"": {}, "spread": {"spread": True}, "plain": {"programs_per_sm": 0}, "fence": {"fused": False}}
SLOTS = ("scattered", "contiguous")
MATRIX = [(f, r, p) for f in FORMATS for r in ROUTES for p in SLOTS]  # (format, route, slot pattern)
#: How late the delayed peer is per combination: shorter than the byte oracle's (15 of
#: them here); a wait removed still fails most combinations (tests/pcp/test_pcp_writer.py
#: proves the fence with the byte oracle).
LATE_S = 0.2


def _value_pairs(combo):
    """Every pair of values a (format, route, pattern) holds, over the four axes main scale,
    indexer scale, route and slot pattern."""
    (main, indexer), route, pattern = combo
    values = list(enumerate((main, indexer, route, pattern)))
    return {(a, b) for i, a in enumerate(values) for b in values[i + 1 :]}


def pairwise(matrix):
    """A subset of ``matrix`` in which every pair of values of two axes appears at least once
    (greedy: each pick adds the most pairs not yet covered; deterministic)."""
    missing = set().union(*(_value_pairs(c) for c in matrix))
    chosen = []
    while missing:
        best = max(matrix, key=lambda c: len(_value_pairs(c) & missing))
        chosen.append(best)
        missing -= _value_pairs(best)
    return chosen


PAIRWISE = pairwise(MATRIX)


def formats_oracle(tokens: int, block_size: int, backend: str = "host", combos=MATRIX):
    """Each (format, route, slot pattern) of ``combos`` into its own cache in one poisoned
    buffer; each rank checks its own replica right after each write, one peer late.
    Scattered slots are a random permutation; contiguous slots are the prompt's positions
    (each rank owns two runs of them, as with a fresh sequence)."""
    world = dist.get_world_size()
    nb = -(-tokens // block_size) + 2  # more slots than tokens: untouched slots stay poisoned
    span = Cache(nb, 1, block_size).end + GUARD_BYTES
    caches = [
        Cache(nb, 1, block_size, base=GUARD_BYTES + i * span, main_scale=m, indexer_scale=x)
        for i, ((m, x), _, _) in enumerate(combos)
    ]
    buf = ss.SymmetricBuffer(caches[-1].end + GUARD_BYTES, backend=backend, channels=2)
    buf.tensor(0, (buf.nbytes,), torch.uint8).fill_(POISON)
    view = buf.view(list(range(world)))
    if buf.capabilities.streams:
        torch.cuda.synchronize()
    dist.barrier()  # every replica is poisoned before anyone writes into it
    kv, pe, ix = special_prompt(tokens)
    g = torch.Generator().manual_seed(7)
    pad = torch.rand(tokens, generator=g) < 0.15  # padding inside the prompt
    scattered = torch.randperm(nb * block_size, generator=g)[:tokens]
    contiguous = torch.arange(tokens) + block_size // 2 + 3  # runs that cross block boundaries
    slot_sets = {"scattered": scattered.masked_fill(pad, -1), "contiguous": contiguous.masked_fill(pad, -1)}
    split = pcp.pcp_split(tokens, world)
    me = view.local_index
    local = [split.local_rows(t, me).contiguous().to(buf.device) for t in (kv, pe, ix)]
    fences = []
    result = {}
    wants = []
    for i, (cache, combo) in enumerate(zip(caches, combos)):
        _, name, pattern = combo
        route, _, option = name.partition("-")
        writer = pcp.DirectKVWriter(view, cache.layout, route=route, timeout_s=60, **OPTIONS[option])
        batch = writer.prepare(split.local_slots(slot_sets[pattern], me).to(buf.device))
        if route == "direct" and me == delayed_writer(0, i, world):
            time.sleep(LATE_S)  # a late peer: the others' write() must wait for its rows
        writer.write(0, *local, batch)
        if buf.capabilities.streams:
            torch.cuda.synchronize()
        wants.append(cache.expected_layer(kv, pe, ix, slot_sets[pattern]))
        result[combo] = first_difference(cache.raw_layer(buf, 0), wants[-1])
        writer.fence.fence()  # a real fence on both routes, after the check
        fences.append(type(writer.fence).__name__)
    if buf.capabilities.streams:
        torch.cuda.synchronize()
    dist.barrier()  # the whole-buffer check reads what every combination wrote
    result["whole_buffer"] = whole_buffer(buf, [(cache.base, want) for cache, want in zip(caches, wants)])
    result["fences"] = fences
    # Writers of one PCP group must agree on the layout, formats included.
    theirs = pcp.CacheLayout(nb, 1, block_size, main_scale="pow2" if buf.rank == 0 else "fp32")
    try:
        pcp.DirectKVWriter(view, theirs)
        result["mismatch"] = None
    except ss.ConfigError as e:
        result["mismatch"] = str(e)
    buf.close()
    return result


def assert_formats_oracle(results, combos=MATRIX):
    for r in results:
        assert r["whole_buffer"] == (0, []), r["whole_buffer"]
        assert r["fences"] == ["Fence"] * len(combos)
        for key in combos:
            assert r[key] == (0, []), (key, r[key])
        assert r["mismatch"] and "the layout differs across ranks" in r["mismatch"], r["mismatch"]


FORMATS_ORACLE = {"host": (24, 8, 300), "cuda": (1000, 64, 600)}  # tokens, block size, time budget


def test_the_pairwise_subset_holds_every_value_of_every_axis_with_every_value_of_every_other():
    assert set().union(*map(_value_pairs, PAIRWISE)) == set().union(*map(_value_pairs, MATRIX))
    assert {c[0] for c in PAIRWISE} == set(FORMATS) and {c[1] for c in PAIRWISE} == set(ROUTES)
    assert {c[2] for c in PAIRWISE} == set(SLOTS) and len(PAIRWISE) < len(MATRIX)


def test_every_format_every_route_matches_its_rule_byte_for_byte(backend, host_ranks):
    """On GPUs the whole matrix of formats, routes and slot patterns; on the host backend every
    pair of values of two axes at least once (the whole matrix there: the soak below)."""
    tokens, block_size, timeout_s = FORMATS_ORACLE[backend]
    if backend == "host":
        results = host_ranks(formats_oracle, 2, tokens, block_size, backend, PAIRWISE, timeout_s=timeout_s)
        assert_formats_oracle(results, PAIRWISE)
    else:
        results = run(formats_oracle, 2, tokens, block_size, backend, backend=backend, timeout_s=timeout_s)
        assert_formats_oracle(results)


@pytest.mark.soak
def test_the_whole_format_matrix_matches_its_rule_on_the_host_backend(host_ranks):
    tokens, block_size, timeout_s = FORMATS_ORACLE["host"]
    assert_formats_oracle(host_ranks(formats_oracle, 2, tokens, block_size, "host", timeout_s=timeout_s))
