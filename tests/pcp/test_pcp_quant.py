"""Byte-exactness tests for the fp8 quantization primitives in symmsync.pcp.quant.

The Triton device functions run under Triton's CPU interpreter here and are
compared byte for byte against the references in tests/oracles.py: plain torch
written from the scale rules (DESIGN.md, "The first consumer"), importing nothing
from symmsync.pcp.quant.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import ast  # noqa: E402
import inspect  # noqa: E402
import textwrap  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from oracles import e4m3, indexer_ref, main_ref  # noqa: E402

from symmsync.pcp import quant  # noqa: E402

FLT_MAX = float(np.finfo(np.float32).max)
BLOCK_T = 16
FLT_MIN = 2.0**-126  # the main-KV "fp32" scale's floor
TOKEN_BYTES = 656  # main KV per token: 512 codes, 4 fp32 scales, 64 bf16 RoPE values


# --------------------------------------------------------------------------
# Test kernels
# --------------------------------------------------------------------------


@triton.jit
def _e4m3_bits_truncating(x):
    """Deliberately wrong conversion (rounds toward zero), for the oracle test."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(bits & 0x7FFFFFFF, 0x7F800000)
    normal = tl.minimum((a >> 20) - 960, 0x7E)
    e = a >> 23
    sig = (a & 0x7FFFFF) | 0x800000
    sub = sig >> tl.minimum(tl.maximum(141 - e, 21), 25)
    code = tl.where(a >= 0x3C800000, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _to_fp8(y, TRUNCATE: tl.constexpr):
    if TRUNCATE:
        q = _e4m3_bits_truncating(y)
    else:
        q = quant.e4m3_bits(y)
    return q


@triton.jit
def _e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TRUNCATE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _to_fp8(x, TRUNCATE), mask=mask)


@triton.jit
def _bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, quant.bf16_to_f32(tl.load(x_ptr + offs, mask=mask)), mask=mask)


@triton.jit
def _scales_kernel(amax_ptr, mla_ptr, idx_ptr, mla2_ptr, idx32_ptr, recip_ptr, e8_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    amax = tl.load(amax_ptr + offs, mask=mask, other=0.0)
    tl.store(mla_ptr + offs, quant.mla_tile_scale(amax), mask=mask)
    si = quant.indexer_scale(amax)
    tl.store(idx_ptr + offs, si, mask=mask)
    tl.store(mla2_ptr + offs, quant.mla_tile_scale_pow2(amax), mask=mask)
    tl.store(idx32_ptr + offs, quant.indexer_scale_fp32(amax), mask=mask)
    tl.store(recip_ptr + offs, quant.pow2_recip(si), mask=mask)
    tl.store(e8_ptr + offs, quant.e8m0_word(si), mask=mask)


@triton.jit
def _mla_kernel(kv_ptr, pe_ptr, out_ptr, T, BLOCK_T: tl.constexpr, TRUNCATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    tile = tl.arange(0, 4)
    col = tl.arange(0, 128)
    inner = tile[None, :, None] * 128 + col[None, None, :]
    m3 = rmask[:, None, None]
    x = quant.bf16_to_f32(tl.load(kv_ptr + rows64[:, None, None] * 512 + inner, mask=m3, other=0.0))
    scale = quant.mla_tile_scale(tl.max(tl.abs(x), axis=2))
    q = _to_fp8(tl.math.div_rn(x, scale[:, :, None]), TRUNCATE)
    row_out = out_ptr + rows64 * 656
    tl.store(row_out[:, None, None] + inner, q, mask=m3)
    scale_ptr = (row_out + 512).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr[:, None] + tile[None, :], scale, mask=rmask[:, None])
    pc = tl.arange(0, 64)
    pe = tl.load(pe_ptr + rows64[:, None] * 64 + pc[None, :], mask=rmask[:, None])
    pe_out = (row_out + 528).to(tl.pointer_type(tl.bfloat16))
    tl.store(pe_out[:, None] + pc[None, :], pe, mask=rmask[:, None])


@triton.jit
def _indexer_kernel(k_ptr, q_ptr, s_ptr, T, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    offs = rows.to(tl.int64)[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = quant.bf16_to_f32(tl.load(k_ptr + offs, mask=rmask[:, None], other=0.0))
    scale = quant.indexer_scale(tl.max(tl.abs(x), axis=1))
    q = quant.e4m3_bits(tl.math.div_rn(x, scale[:, None]))
    tl.store(q_ptr + offs, q, mask=rmask[:, None])
    tl.store(s_ptr + rows, scale, mask=rmask)


# --------------------------------------------------------------------------
# Host wrappers and oracles
# --------------------------------------------------------------------------


def _block(n: int) -> int:
    return min(1 << 20, triton.next_power_of_2(max(n, 16)))


def run_e4m3(x: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    x = x.to(torch.float32).contiguous().reshape(-1)
    out = torch.empty(x.shape, dtype=torch.uint8)
    n = x.numel()
    if n:
        block = _block(n)
        _e4m3_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, TRUNCATE=truncate)
    return out


def run_scales(amax: torch.Tensor, every: bool = False):
    amax = amax.to(torch.float32).contiguous()
    mla, idx, mla2, idx32, recip = (torch.empty_like(amax) for _ in range(5))
    e8 = torch.empty(amax.shape, dtype=torch.int32)
    n = amax.numel()
    if n:
        block = _block(n)
        _scales_kernel[(triton.cdiv(n, block),)](amax, mla, idx, mla2, idx32, recip, e8, n, BLOCK=block)
    return (mla, idx, mla2, idx32, recip, e8) if every else (mla, idx)


def run_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    t = kv_c.shape[0]
    out = torch.full((t, TOKEN_BYTES), 0xA5, dtype=torch.uint8)
    if t:
        _mla_kernel[(triton.cdiv(t, BLOCK_T),)](
            kv_c.contiguous(), k_pe.contiguous(), out, t, BLOCK_T=BLOCK_T, TRUNCATE=truncate
        )
    return out


def run_indexer(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = k.shape[0]
    q = torch.full((t, 128), 0xA5, dtype=torch.uint8)
    s = torch.full((t,), -1.0, dtype=torch.float32)
    if t:
        _indexer_kernel[(triton.cdiv(t, BLOCK_T),)](k.contiguous(), q, s, t, BLOCK_T=BLOCK_T)
    return q, s


def expected_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The reference (:func:`oracles.e4m3`) for |x| < 464; the documented rule (saturate,
    NaN 0x7F) elsewhere."""
    x = x.to(torch.float32)
    sign = (x.view(torch.int32) < 0).to(torch.uint8) * 0x80
    rule = torch.where(torch.isnan(x), 0x7F, 0x7E).to(torch.uint8) | sign
    return torch.where(x.abs() < 464.0, e4m3(torch.where(x.abs() < 464.0, x, 0.0)), rule)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str, inputs=None) -> None:
    assert got.dtype == want.dtype == torch.uint8, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = (got != want).nonzero()
    if bad.shape[0]:
        i = tuple(bad[0].tolist())
        extra = f" (input {inputs[i].item()!r})" if inputs is not None else ""
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {got.numel()} bytes differ; first at {i}: "
            f"got {got[i].item():#04x}, want {want[i].item():#04x}{extra}"
        )


def check_e4m3(x: torch.Tensor, truncate: bool = False) -> None:
    x = x.to(torch.float32).reshape(-1)
    assert_bytes_equal(run_e4m3(x, truncate), expected_e4m3(x), "e4m3_bits", x)


def check_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, truncate: bool = False) -> None:
    # The test kernel uses the legacy ("fp32") tile scale.
    want = main_ref(kv_c, k_pe, "fp32")
    assert_bytes_equal(run_mla(kv_c, k_pe, truncate), want, "fp8_ds_mla")


def check_indexer(k: torch.Tensor) -> None:
    q, s = run_indexer(k)
    q_ref, s_ref = indexer_ref(k, "ue8m0")
    assert_bytes_equal(q, q_ref, "indexer codes")
    assert_bytes_equal(s.view(torch.uint8), s_ref.reshape(-1), "indexer scales")


def f32(bits) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def bf16(bits) -> torch.Tensor:
    b = torch.as_tensor(bits, dtype=torch.int64)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def random_bf16(gen: torch.Generator, shape, kind: str) -> torch.Tensor:
    if kind == "normal":
        # Gaussian rows whose 64-wide blocks span 1e-8 .. 1e8.
        x = torch.randn(shape, generator=gen)
        exps = torch.empty(shape[0], shape[1] // 64, 1).uniform_(-8, 8, generator=gen)
        x = x.reshape(shape[0], shape[1] // 64, 64) * torch.pow(10.0, exps)
        return x.reshape(shape).to(torch.bfloat16)
    # Arbitrary finite bf16 bit patterns: subnormals next to huge values.
    b = torch.randint(0, 1 << 16, shape, generator=gen)
    exp_all_ones = (b & 0x7F80) == 0x7F80
    return bf16(torch.where(exp_all_ones, b ^ 0x0080, b))


# --------------------------------------------------------------------------
# e4m3_bits
# --------------------------------------------------------------------------


def _e4m3_edge_values() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours (and 448|480), +-1 ulp."""
    pos = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    grid = torch.cat([pos, torch.tensor([480.0], dtype=torch.float64)])
    mids = (grid[:-1] + grid[1:]) / 2
    pts = torch.cat([grid, mids]).to(torch.float32)
    assert torch.equal(pts.to(torch.float64), torch.cat([grid, mids]))  # all exact in fp32
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(np.inf)), torch.nextafter(pts, torch.tensor(-np.inf))])
    return torch.cat([pts, -pts])


def test_e4m3_every_value_midpoint_and_neighbour():
    x = _e4m3_edge_values()
    check_e4m3(x)
    # The midpoints really exercise ties-to-even: e.g. 1.3125 -> 1.25, 464 -> 448.
    got = run_e4m3(torch.tensor([1.3125, 1.4375, -1.3125, 464.0, 2.0**-10, 3 * 2.0**-10]))
    assert got.tolist() == [0x3A, 0x3C, 0xBA, 0x7E, 0x00, 0x02]


def test_e4m3_zeros_subnormals_and_power_of_two_carries():
    x = torch.cat(
        [
            torch.tensor([0.0, -0.0, 31.29, -31.29, 15.9, 0.0155, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10]),
            f32([1, 2, 3, 0x7FFFFF, 0x800000, 0x800001, 0x00400000, 0x3A800000, 0x3A800001, 0x3AFFFFFF]),
            torch.randint(1, 0x800000, (4096,), generator=torch.Generator().manual_seed(7))
            .to(torch.int32)
            .view(torch.float32),
        ]
    )
    check_e4m3(torch.cat([x, -x]))
    got = run_e4m3(torch.tensor([31.29, 0.0, -0.0, 1e-45, -1e-45]))
    assert got.tolist() == [0x60, 0x00, 0x80, 0x00, 0x80]


def test_e4m3_near_448_saturation_inf_nan():
    near = torch.linspace(440.0, 470.0, 2001)
    exact = f32([0x43E00000, 0x43E00001, 0x43E7FFFF, 0x43E80000, 0x43E80001, 0x43F00000, 0x7F7FFFFF])
    nonfinite = f32([0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF])
    x = torch.cat([near, exact, torch.tensor([1e4, 1e30, 3.4e38]), nonfinite])
    x = torch.cat([x, -x])
    check_e4m3(x)
    got = run_e4m3(torch.tensor([448.0, 463.99, 464.0, 500.0, np.inf, -np.inf, -1e30, np.nan]))
    assert got.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]
    assert run_e4m3(f32([0xFFC00000])).tolist() == [0xFF]  # NaN keeps its sign bit


def test_e4m3_large_random_samples():
    gen = torch.Generator().manual_seed(1234)
    n = 1 << 20
    sign = torch.randint(0, 2, (n,), generator=gen).to(torch.int64) << 31
    # Uniform over the bit patterns of |x| < 464 (every exponent equally often).
    in_range = f32(torch.randint(0, 0x43E80000, (n,), generator=gen) | sign)
    # Uniform in value.
    uniform = (torch.rand(n, generator=gen) * 928.0 - 464.0).clamp(-463.99, 463.99)
    # Any 32-bit pattern at all (NaN, inf and huge values included).
    anything = f32(torch.randint(0, 1 << 32, (n,), generator=gen))
    check_e4m3(torch.cat([in_range, uniform, anything]))


_FINITE_BELOW_464 = st.floats(
    min_value=-464.0,
    max_value=464.0,
    exclude_min=True,
    exclude_max=True,
    allow_nan=False,
    allow_infinity=False,
    allow_subnormal=True,
    width=32,
)


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(_FINITE_BELOW_464, min_size=1, max_size=4096))
def test_e4m3_property_matches_torch(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert_bytes_equal(run_e4m3(x), e4m3(x), "e4m3_bits", x)


def test_torch_cast_behaviour_matches_documented_rule():
    """Documents torch's own behaviour that the module docstring relies on."""
    x = torch.tensor([464.0, 465.0, 479.9, 480.0, 1e30, np.inf, -np.inf, -500.0, np.nan])
    got = x.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    if got[1] != 0x7E:
        pytest.skip(f"this torch ({torch.__version__}) does not saturate fp8 casts")
    assert got[:-1] == [0x7E] * 6 + [0xFE, 0xFE]
    assert got[-1] & 0x7F == 0x7F


def test_bf16_to_f32_every_pattern():
    x = bf16(torch.arange(1 << 16))
    out = torch.empty(x.shape, dtype=torch.float32)
    _bf16_kernel[(16,)](x, out, x.numel(), BLOCK=1 << 12)
    assert torch.equal(out.view(torch.int32), x.to(torch.float32).view(torch.int32))


# --------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------


def _amax_edge_values() -> torch.Tensor:
    pows = torch.tensor([448.0 * 2.0**k for k in range(-130, 119)], dtype=torch.float64).to(torch.float32)
    base = torch.cat(
        [
            torch.tensor([0.0, 1e-45, 1e-40, 1e-4, 1e-3, 0.04479, 0.0448, 1.0, 448.0, 1e30, 3e38, FLT_MAX]),
            f32([0x00000001, 0x007FFFFF, 0x00800000, 0x38D1B717, 0x38D1B716, 0x38D1B718]),
            torch.tensor([448.0 * FLT_MIN], dtype=torch.float32),
            pows,
        ]
    )
    out = torch.cat([base, torch.nextafter(base, torch.tensor(np.inf)), torch.nextafter(base, torch.tensor(0.0))])
    return out[out <= FLT_MAX]


def _expected_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent numpy oracle for both scales (float32 numpy division is IEEE)."""
    a = amax.numpy().astype(np.float32)
    mla = np.maximum(a / np.float32(448.0), np.float32(FLT_MIN))
    m = np.maximum(a, np.float32(1e-4)) / np.float32(448.0)
    # log2 of a float32 in float64 is far from any integer unless m is an
    # exact power of two (then it is exact), so ceil() is reliable here.
    idx = np.exp2(np.ceil(np.log2(m.astype(np.float64)))).astype(np.float32)
    return torch.from_numpy(mla), torch.from_numpy(idx)


def _check_scales(amax: torch.Tensor) -> None:
    mla, idx, mla2, idx32, recip, e8 = run_scales(amax, every=True)
    mla_ref, idx_ref = _expected_scales(amax)
    assert_bytes_equal(mla.view(torch.uint8), mla_ref.view(torch.uint8), "mla_tile_scale")
    assert_bytes_equal(idx.view(torch.uint8), idx_ref.view(torch.uint8), "indexer_scale")
    # The current formats: pow2 main scale (floor on the quotient), plain fp32 indexer
    # scale, the reciprocal of a power of two, and the mxfp8 field (E8M0 byte 4 times).
    a = amax.numpy().astype(np.float32)
    m2 = np.maximum(a / np.float32(448.0), np.float32(1e-4)).astype(np.float64)
    mla2_ref = torch.from_numpy(np.exp2(np.ceil(np.log2(m2))).astype(np.float32))
    idx32_ref = torch.from_numpy(np.maximum(a, np.float32(1e-4)) / np.float32(448.0))
    assert_bytes_equal(mla2.view(torch.uint8), mla2_ref.view(torch.uint8), "mla_tile_scale_pow2")
    assert_bytes_equal(idx32.view(torch.uint8), idx32_ref.view(torch.uint8), "indexer_scale_fp32")
    recip_ref = (1.0 / idx_ref.double()).float()
    assert_bytes_equal(recip.view(torch.uint8), recip_ref.view(torch.uint8), "pow2_recip")
    ebyte = (torch.log2(idx_ref.double()).round().to(torch.int64) + 127).to(torch.uint8)
    assert_bytes_equal(e8.view(torch.uint8), ebyte.repeat_interleave(4), "e8m0_word")
    # Properties of the indexer scale: a power of two, the smallest >= m.
    m = torch.maximum(amax, torch.tensor(1e-4)) / torch.full_like(amax, 448.0)
    assert torch.all((idx.view(torch.int32) & 0x7FFFFF) == 0)
    assert torch.all(idx >= m) and torch.all(idx / 2 < m)


def test_scales_edge_values():
    _check_scales(_amax_edge_values())
    mla, idx = run_scales(torch.tensor([0.0, 448.0, 1.0, 1e-4]))
    assert mla.tolist()[:2] == [FLT_MIN, 1.0]
    assert idx.tolist() == [2.0**-22, 1.0, 2.0**-8, 2.0**-22]


@settings(max_examples=30, deadline=None, database=None)
@given(st.lists(st.floats(min_value=0.0, max_value=FLT_MAX, width=32), min_size=1, max_size=1024))
def test_scales_property(values):
    _check_scales(torch.tensor(values, dtype=torch.float32))


# --------------------------------------------------------------------------
# Whole tokens
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "bits"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("t", [0, 1, 3, 64, 65])
def test_mla_and_indexer_random(t, seed, kind):
    gen = torch.Generator().manual_seed(1000 * seed + t)
    kv_c = random_bf16(gen, (t, 512), kind)
    k_pe = bf16(torch.randint(0, 1 << 16, (t, 64), generator=gen))  # any bits, NaNs included
    check_mla(kv_c, k_pe)
    check_indexer(random_bf16(gen, (t, 128), kind))


def _special_rows(width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    n = width // 4
    sub = bf16(torch.randint(1, 0x80, (width,), generator=gen) | (torch.randint(0, 2, (width,), generator=gen) << 15))
    signed_zero = bf16(torch.arange(width) % 2 * 0x8000)
    large = torch.tensor([1e30, -3e38, 3.3e38, -1e38] * n).to(torch.bfloat16)
    mixed = torch.cat(
        [
            sub[:n],
            torch.tensor([1e30, -1e-40, 1.0, -0.0] * (n // 4)),
            torch.tensor([-3e38, 1e-38, 5e-36, 0.0] * (n // 4)),
            torch.tensor([448.0, -(2.0**-20), 7.0, 1e-4] * (n // 4)),
        ]
    ).to(torch.bfloat16)
    near_floor = torch.tensor([5.27e-36, -5.26e-36, 5.28e-36, 1e-37] * n).to(torch.bfloat16)
    near_idx_floor = torch.tensor([1e-4, -9.99e-5, 1.001e-4, 3e-5] * n).to(torch.bfloat16)
    pow2 = torch.tensor([448.0 * 2.0**-5, 0.5, -3.0, 1.0] * n).to(torch.bfloat16)
    rows = [
        torch.zeros(width, dtype=torch.bfloat16),
        signed_zero,
        -torch.zeros(width, dtype=torch.bfloat16),
        sub,
        large,
        mixed,
        near_floor,
        near_idx_floor,
        pow2,
    ]
    return torch.stack([r.reshape(width) for r in rows])


def test_mla_special_rows():
    kv_c = _special_rows(512)
    k_pe = bf16(torch.tensor([0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x8000, 0x7F7F, 0x3F80] * 8)).repeat(
        kv_c.shape[0], 1
    )
    check_mla(kv_c, k_pe)
    got = run_mla(kv_c, k_pe)
    # Rows of zeros use the FLT_MIN floor; -0 stays -0.
    scales = got[:, 512:528].contiguous().view(torch.float32)
    assert torch.all(scales[:3] == FLT_MIN)
    assert torch.all(got[0, :512] == 0) and torch.all(got[2, :512] == 0x80)
    assert torch.equal(got[:, 528:], k_pe.view(torch.uint8))


def test_indexer_special_rows():
    k = _special_rows(128)
    check_indexer(k)
    q, s = run_indexer(k)
    assert torch.all(s[:4] == 2.0**-22)  # amax below 1e-4 uses the floor
    assert torch.all(q[0] == 0) and torch.all(q[2] == 0x80)


def test_reference_by_hand():
    kv_c = torch.ones(1, 512, dtype=torch.bfloat16)
    kv_c[0, 128:256] = 448.0
    kv_c[0, 256:384] = 0.0
    kv_c[0, 384:] = -2.0
    k_pe = torch.full((1, 64), -1.5, dtype=torch.bfloat16)
    got = main_ref(kv_c, k_pe, "fp32")
    assert got.shape == (1, 656)
    # 1 / (1/448 rounded) rounds back to 448; tile 1 has scale 1; tile 3 -> -448.
    assert got[0, :128].unique().tolist() == [0x7E]
    assert got[0, 128:256].unique().tolist() == [0x7E]
    assert got[0, 256:384].unique().tolist() == [0x00]
    assert got[0, 384:512].unique().tolist() == [0xFE]
    scales = got[0, 512:528].view(torch.float32)
    assert scales.tolist() == [np.float32(1) / np.float32(448), 1.0, FLT_MIN, np.float32(2) / np.float32(448)]
    assert got[0, 528:].view(torch.bfloat16).tolist() == [-1.5] * 64
    q, s = indexer_ref(torch.ones(1, 128, dtype=torch.bfloat16), "ue8m0")
    assert s.view(torch.float32).reshape(-1).tolist() == [2.0**-8] and q.unique().tolist() == [0x78]  # 1 / 2**-8 = 256
    assert main_ref(kv_c[:0], k_pe[:0], "pow2").shape == (0, 656)
    assert indexer_ref(torch.ones(0, 128, dtype=torch.bfloat16), "ue8m0")[0].shape == (0, 128)


# --------------------------------------------------------------------------
# The oracle bites
# --------------------------------------------------------------------------


def test_oracle_detects_truncating_rounding():
    with pytest.raises(AssertionError, match="e4m3_bits"):
        check_e4m3(_e4m3_edge_values(), truncate=True)
    gen = torch.Generator().manual_seed(5)
    kv_c = random_bf16(gen, (8, 512), "normal")
    k_pe = random_bf16(gen, (8, 64), "normal")
    with pytest.raises(AssertionError, match="fp8_ds_mla"):
        check_mla(kv_c, k_pe, truncate=True)
    # Truncation only ever lands one code below the right answer.
    diff = main_ref(kv_c, k_pe, "fp32").to(torch.int16) - run_mla(kv_c, k_pe, True).to(torch.int16)
    assert set(diff.unique().tolist()) == {0, 1}


def test_device_functions_avoid_inexact_ops():
    """No `/` (approximate on GPU) and no float8 casts in the device functions."""
    for fn in (
        quant.e4m3_bits,
        quant.bf16_to_f32,
        quant.mla_tile_scale,
        quant.indexer_scale,
        quant.mla_tile_scale_pow2,
        quant.indexer_scale_fp32,
        quant.pow2_ceil,
        quant.pow2_recip,
        quant.e8m0_word,
    ):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
        for node in ast.walk(tree):
            assert not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)), fn.fn.__name__
            assert not (isinstance(node, ast.Attribute) and node.attr.startswith("float8")), fn.fn.__name__
