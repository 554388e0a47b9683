"""Oracles shared by the PCP tests, on the host backend and on GPUs.

Test modules do not import each other: what several of them use lives here.

* The cache references, plain torch written from the format rules in docs/pcp.md
  ("Cache formats"), sharing no code with ``symmsync.pcp.quant``. ``amax`` is the
  largest ``|x|`` of a main-KV tile (128 values) or of an indexer-K token (128
  values), every division is an IEEE fp32 division, and a code is ``e4m3fn(x / s)``
  rounded to nearest even and saturating at +-448:

  * main ``"pow2"``: ``s`` = the smallest power of two >= ``max(amax / 448, 1e-4)``;
  * main ``"fp32"``: ``s = max(amax / 448, 2**-126)``;
  * indexer ``"ue8m0"``: ``s`` = the smallest power of two >= ``max(amax, 1e-4) / 448``;
  * indexer ``"fp32"``: ``s = max(amax, 1e-4) / 448``;
  * indexer ``"mxfp8"``: ``s`` as ``"ue8m0"``; the 4-byte field holds ``log2(s) + 127``
    four times.

  The byte offsets (656 bytes of main KV per token at ``slot * 656``; per indexer block,
  ``block_size`` rows of 128 values then ``block_size`` 4-byte scale fields) are
  written out here as numbers on purpose: the oracle does not read the layout it checks.
* :func:`prompt`: a seeded prompt with edge-case rows.
* :func:`byte_oracle`: a rank function writing one prompt by every route and checking
  every replica against the references, against the all-gather route, and its guard
  bytes (:func:`assert_byte_oracle` checks what every rank returns).
"""

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import pcp

F32_1E4 = torch.tensor(1e-4, dtype=torch.float32)  # the fp32 value nearest to 1e-4
FLT_MIN = torch.tensor(2.0**-126, dtype=torch.float32)
F448 = torch.tensor(448.0, dtype=torch.float32)


# ---------------------------------------------------------------------- the references
def e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn bits, nearest even, saturating at +-448 (finite ``y``).

    Clamping first is the saturation: every ``|y|`` in (448, 464] rounds to 448 (464 is
    the tie between 448 and the NaN code above it, and 448's mantissa is even), and
    larger values saturate; below 448 torch's cast rounds to nearest even.
    """
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def pow2_at_least(m: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive fp32 ``m`` (log2 in float64 is exact
    for powers of two and far from an integer otherwise)."""
    return torch.exp2(torch.ceil(torch.log2(m.double()))).float()


def main_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[T, 656]`` main-KV bytes: 512 codes, 4 fp32 tile scales, 64 bf16 values."""
    t = kv_c.shape[0]
    x = kv_c.float().reshape(t, 4, 128)
    amax = x.abs().amax(dim=-1, keepdim=True)
    q = amax / F448
    s = pow2_at_least(torch.maximum(q, F32_1E4)) if fmt == "pow2" else torch.maximum(q, FLT_MIN)
    codes = e4m3(x / s).reshape(t, 512)
    scales = s.reshape(t, 4).contiguous().view(torch.uint8)
    return torch.cat([codes, scales, k_pe.contiguous().view(torch.uint8)], dim=1)


def indexer_ref(indexer_k: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T, 128] codes, [T, 4] scale field)`` of the indexer K."""
    x = indexer_k.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    m = torch.maximum(amax, F32_1E4) / F448
    s = m if fmt == "fp32" else pow2_at_least(m)
    codes = e4m3(x / s)
    if fmt == "mxfp8":
        biased = (torch.log2(s.double()).round().to(torch.int64) + 127).to(torch.uint8)
        field = biased.reshape(-1, 1).repeat(1, 4)
    else:
        field = s.reshape(-1, 1).contiguous().view(torch.uint8)
    return codes, field


def oracle_backing(layout, kv_c, k_pe, indexer_k, slots) -> torch.Tensor:
    """One layer's whole backing (both regions and their padding) for a prompt."""
    bs = layout.block_size
    main = torch.zeros(layout.main_bytes, dtype=torch.uint8)
    ind = torch.zeros(layout.indexer_bytes, dtype=torch.uint8)
    tok = main_ref(kv_c, k_pe, layout.main_scale)
    codes, field = indexer_ref(indexer_k, layout.indexer_scale)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        main[s * 656 : (s + 1) * 656] = tok[t]
        b, o = divmod(s, bs)
        blk = b * bs * 132
        ind[blk + o * 128 : blk + (o + 1) * 128] = codes[t]
        ind[blk + bs * 128 + o * 4 : blk + bs * 128 + o * 4 + 4] = field[t]
    return torch.cat([main, ind])


def oracle_cache(layout, kv_c, k_pe, indexer_k, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """``(main [blocks, block_size, 656], indexer [blocks, block_size * 132])`` of a prompt:
    what ``layout.main_kv`` and ``layout.indexer_k`` must show after it was written."""
    back = oracle_backing(layout, kv_c, k_pe, indexer_k, slots)
    n = layout.num_slots * 656
    main = back[:n].view(layout.num_blocks, layout.block_size, 656)
    ib = layout.block_size * 132
    ind = back[layout.main_bytes : layout.main_bytes + layout.num_blocks * ib].view(layout.num_blocks, ib)
    return main, ind


# ---------------------------------------------------------------------- a prompt
def prompt(seed, tokens, num_slots, special=False):
    """``(kv_c, k_pe, indexer_k, slots)`` of a seeded prompt: bf16 rows, distinct slots.

    With ``special``: a zero row, negative zeros, bf16 subnormals and large values first.
    """
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
GUARD = 0xA5
BLOCK = 64
BYTE_ORACLE_ROUTES = [("direct", False), ("direct", True), ("allgather", False)]


def byte_oracle(tp, tokens, num_layers, seed, backend="host"):
    """Rank function: every route writes one prompt (TP x PCP over the world, ``tp``
    TP ranks per PCP rank) into its own layout of one buffer, guard bytes between them;
    returns per route and layer whether this rank's replica equals the references and
    the all-gather route's bytes, and whether the guard bytes stayed untouched."""
    world = dist.get_world_size()
    p = world // tp
    layout0 = pcp.CacheLayout(num_blocks=max(1, -(-tokens // BLOCK)) + 1, num_layers=num_layers, base=128)
    span = layout0.nbytes + 256  # each route's layout, with guard bytes between them
    n = len(BYTE_ORACLE_ROUTES)
    layouts = [pcp.CacheLayout(layout0.num_blocks, num_layers, BLOCK, base=128 + i * span) for i in range(n)]
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
    for i, (route, fused) in enumerate(BYTE_ORACLE_ROUTES):
        writer = pcp.DirectKVWriter(
            view, layouts[i], route=route, fused=fused, group=group, channel=i % 2, timeout_s=60
        )
        batch = writer.prepare(split.local_slots(slots, me).to(buf.device))
        for layer in range(num_layers):
            # Different inputs per layer, so a layer written into another layer's place shows.
            writer.write(layer, *[(t.float() * (layer + 1)).to(torch.bfloat16) for t in local], batch)
    if buf.capabilities.streams:
        torch.cuda.synchronize()
    dist.barrier()
    baseline = BYTE_ORACLE_ROUTES.index(("allgather", False))
    for layer in range(num_layers):
        want = oracle_cache(layouts[0], *[(t.float() * (layer + 1)).to(torch.bfloat16) for t in (kv, pe, ix)], slots)
        base = (layouts[baseline].main_kv(buf, layer).cpu(), layouts[baseline].indexer_k(buf, layer).cpu())
        for i, (route, fused) in enumerate(BYTE_ORACLE_ROUTES):
            got = (layouts[i].main_kv(buf, layer).cpu(), layouts[i].indexer_k(buf, layer).cpu())
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


def assert_byte_oracle(results, num_layers):
    """Every rank's :func:`byte_oracle` result: every route, every layer, every check."""
    for r in results:
        assert r["guards_untouched"] and r["guard_bytes"] > 0
        for key in ("direct", "direct-fused", "allgather"):
            assert r[key] == [(True, True, True, True)] * num_layers, (key, r[key])
