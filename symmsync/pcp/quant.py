"""Bit-exact fp8 (e4m3fn) quantization primitives for KV-cache writers.

This module provides Triton device functions for the two fp8 layouts used by
DeepSeek-V3.2 sparse MLA KV caches, in each of their scale formats. The Triton
functions give byte-identical results when compiled for NVIDIA GPUs and when
run by Triton's CPU interpreter (``TRITON_INTERPRET=1``); the expected bytes
come from plain torch references written from the formats' rules, which live with
the tests (``tests/oracles.py``), apart from the code they check.

Formats
-------
The bytes of both caches and the scale rules of each format are stated once, in
:mod:`symmsync.pcp.layout` (docs/pcp.md shows them): codes ``e4m3fn(x / s)`` of fp32
values, tile (main KV) or token (indexer K) scales from ``amax`` by IEEE fp32 division,
``"pow2"`` and ``"fp32"`` main-KV scales (:data:`MAIN_SCALES`), ``"ue8m0"``, ``"fp32"`` and
``"mxfp8"`` indexer scales (:data:`INDEXER_SCALES`; :func:`e8m0_word` builds the mxfp8
field). This docstring says how the Triton functions reach the same bytes on both
backends.

With a power-of-two scale the kernels multiply by its reciprocal
(:func:`pow2_recip`, exact) instead of dividing: ``x * (1 / s)`` and the IEEE
quotient ``x / s`` are both the correctly rounded value of the same real
number, so they are equal for every fp32 ``x``, also where the result is an
fp32 subnormal (no instruction here flushes subnormals).

Conversion to e4m3fn (:func:`e4m3_bits`)
----------------------------------------
Round-to-nearest-even, identical to
``t.to(torch.float8_e4m3fn).view(torch.uint8)`` in torch 2.13 for every fp32
input: finite ``|x| < 464`` rounds normally (``+0 -> 0x00``, ``-0 -> 0x80``,
fp32 subnormals ``-> 0x00/0x80``, e4m3 subnormals ``k * 2**-9``); 464 is the
midpoint between 448 and the (NaN) code above it and rounds to the even
code 448; every larger finite value and ``+-inf`` saturates to ``+-448``
(``0x7E``/``0xFE``); NaN gives ``0x7F`` with the input's sign bit (so
``0x7F`` or ``0xFF``). Earlier torch releases gave the NaN code instead of
saturating above 464; the callers here never reach that range (their
``|x / s|`` is at most about ``448 * (1 + 2**-22)``).

Why the results are exact on both backends
------------------------------------------
* :func:`to_e4m3` is picked when this module is imported: compiled, it is the
  hardware conversion ``x.to(tl.float8e4nv)`` (``cvt.rn.satfinite.e4m3x2.f32``
  on sm_89 and later), which the GPU suite proves equal to :func:`e4m3_bits`
  for all 2**32 fp32 bit patterns but NaNs (a NaN gives a NaN code, its sign
  not compared); interpreted, it is :func:`e4m3_bits`.
* :func:`e4m3_bits` uses only 32-bit integer operations (bitcast, and/or,
  shifts by amounts clamped to ``[21, 25]``, adds that cannot overflow,
  compares, ``tl.where``), which have a single defined result on the GPU and
  in numpy. The interpreter's ``x.to(tl.float8e4nv)`` (checked in triton 3.6
  and 3.9) disagrees with the GPU and torch: halfway cases round away from zero (1.3125 -> 1.375),
  the carry is lost when rounding crosses a power of two (31.29 -> 16),
  values in (2**-10, 2**-9) and fp32 subnormals round the wrong way, and
  out-of-range inputs give odd codes (464 -> NaN, inf -> 256).
* Divisions use ``tl.math.div_rn`` (available in triton 3.6 through 3.9). It
  builds ``tt.precise_divf``, which NVIDIA lowers to a plain LLVM ``fdiv``
  (PTX ``div.rn.f32``, IEEE round-to-nearest) and the interpreter runs as
  numpy float32 division (also IEEE). The ``/`` operator is not used: for
  fp32 Triton lowers it to an approximate division (``div.full.f32`` in
  3.6, ``div.approx.f32`` in 3.9). Kernels built from these functions for
  sm_90 with triton 3.6 and 3.9 contain ``div.rn.f32``, ``max.f32`` and
  ``abs.f32`` and no ``.ftz`` instruction (Triton's ``nvvm-reflect-ftz`` flag
  only affects libdevice calls, which are not used here).
* ``max`` against a normal constant, and choosing a power of two by
  masking the fp32 bits, are exact. :func:`mla_tile_scale` does not depend on
  whether subnormals are flushed: ``amax / 448`` is below ``FLT_MIN``
  whenever it or ``amax`` is subnormal, so the floor applies either way.
  :func:`mla_tile_scale_pow2`, :func:`indexer_scale` and
  :func:`indexer_scale_fp32` apply floors far above the subnormals.
* Constants (``448.0``, ``FLT_MIN``, ``1e-4``) are fp32 values converted
  from Python floats by round-to-nearest on both backends; ``448`` and
  ``FLT_MIN`` are exact.
* bf16 inputs are widened with :func:`bf16_to_f32` (a 16-bit shift of the
  bits), not ``.to(tl.float32)``: the interpreter's bf16 -> fp32 conversion
  gets bf16 subnormals wrong (bits ``0x0001`` become 0, ``0x003C`` becomes
  about 1.03e-38 instead of 5.5e-39).

A caller loads bf16 ``x``, widens it with ``bf16_to_f32``, computes ``amax``
as ``tl.max(tl.abs(x), axis=...)`` (exact), and quantizes with
``to_e4m3(tl.math.div_rn(x, s))`` (or ``to_e4m3(x * pow2_recip(s))`` for a
power-of-two ``s``). ``tl.math.div_rn`` broadcasts its
operands like the arithmetic operators do. Inputs are expected to be
finite: an inf or NaN in a tile makes its scale inf or NaN, and NaNs made by
arithmetic carry backend-dependent sign bits (x86 gives negative NaNs, NVIDIA
positive ones), so such tiles are not byte-reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..backends import mode

__all__ = [
    "FP8_E4M3_MAX",
    "FLT_MIN",
    "INDEXER_AMAX_FLOOR",
    "MLA_TILE",
    "MLA_NOPE_DIM",
    "MLA_ROPE_DIM",
    "MLA_TOKEN_BYTES",
    "INDEXER_DIM",
    "e4m3_bits",
    "bf16_to_f32",
    "mla_tile_scale",
    "mla_tile_scale_pow2",
    "indexer_scale",
    "indexer_scale_fp32",
    "pow2_ceil",
    "e8m0_word",
    "pow2_recip",
    "to_e4m3",
    "MAIN_SCALES",
    "MAIN_SCALE_FLOOR",
    "INDEXER_SCALES",
]

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

FLT_MIN = 1.1754943508222875e-38
"""Smallest normal fp32 value, ``2**-126``; the floor of the MLA tile scales."""

INDEXER_AMAX_FLOOR = 1e-4
"""Floor applied to the indexer ``amax`` (rounded to fp32, bits 0x38D1B717)."""

MAIN_SCALE_FLOOR = 1e-4
"""Floor applied to the main-KV quotient ``amax / 448`` of the ``"pow2"`` format (fp32)."""

MAIN_SCALES = ("pow2", "fp32")
"""Main-KV tile-scale formats: ``"pow2"`` (vLLM >= 0.33, FlashMLA), ``"fp32"`` (vLLM <= 0.11)."""

INDEXER_SCALES = ("ue8m0", "fp32", "mxfp8")
"""Indexer-K scale formats (vLLM 0.33): power of two as fp32, plain fp32, or 4 E8M0 bytes."""

MLA_TILE = 128
MLA_NOPE_DIM = 512
MLA_ROPE_DIM = 64
MLA_TOKEN_BYTES = MLA_NOPE_DIM + 4 * (MLA_NOPE_DIM // MLA_TILE) + 2 * MLA_ROPE_DIM
INDEXER_DIM = 128


@triton.jit
def e4m3_bits(x):
    """Converts fp32 values to float8_e4m3fn bit patterns (round to nearest even).

    Pure 32-bit integer arithmetic on the fp32 bits, so the result is the same
    compiled and interpreted. Matches torch 2.13's ``float8_e4m3fn`` cast for
    every fp32 input; see the module docstring for the saturation, infinity
    and NaN rules.

    Args:
        x: fp32 tensor.

    Returns:
        uint8 tensor of the same shape holding the e4m3fn bit patterns.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    # |x| as bits; clamping at +inf keeps every sum below 2**31.
    mag = bits & 0x7FFFFFFF
    a = tl.minimum(mag, 0x7F800000)
    # Normal e4m3 range (|x| >= 2**-6): keep 3 mantissa bits, round the 20
    # dropped bits to nearest even (adding 0x7FFFF plus the kept lsb carries
    # exactly when the dropped part is above half, or is half and lsb is odd;
    # a carry out of the mantissa bumps the exponent), then rebias the
    # exponent from 127 to 7 (120 << 3 == 960 in the shifted word).
    lsb = (a >> 20) & 1
    normal = ((a + 0x7FFFF + lsb) >> 20) - 960
    normal = tl.minimum(normal, 0x7E)  # 480 and above saturate to 448
    # e4m3 subnormal range (|x| < 2**-6): the code is |x| / 2**-9 rounded to
    # nearest even; |x| = sig * 2**(e - 150) so the code is sig >> (141 - e)
    # rounded the same way. Shifts of 25 or more give 0 (sig < 2**24), so
    # clamp there; fp32 subnormals (e == 0) land in that clamped case. A
    # result of 8 is exactly the smallest normal code 0x08. The lower clamp
    # only keeps the unused lanes (normal range) free of undefined shifts.
    e = a >> 23
    sig = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - e, 21), 25)
    half = 1 << (shift - 1)
    sub = (sig + (half - 1) + ((sig >> shift) & 1)) >> shift
    code = tl.where(a >= 0x3C800000, normal, sub)
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def bf16_to_f32(x):
    """Widens bf16 values to fp32 exactly, through their bits.

    Use this instead of ``x.to(tl.float32)``: Triton's interpreter (3.6
    through 3.9) converts bf16 subnormals to wrong fp32 values (``0x0001``
    becomes 0). Compiled, both forms are exact.

    Args:
        x: bf16 tensor.

    Returns:
        fp32 tensor with the same values.
    """
    bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mla_tile_scale(amax):
    """Scale of one fp8_ds_mla tile: ``max(amax / 448, FLT_MIN)``.

    Args:
        amax: fp32 tensor, the largest ``|x|`` of each tile (non-negative).

    Returns:
        fp32 tensor of scales, the division rounded to nearest (IEEE).
    """
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)


@triton.jit
def indexer_scale(amax):
    """Power-of-two indexer scale: the smallest ``2**k >= max(amax, 1e-4) / 448``.

    The quotient is an IEEE round-to-nearest fp32 division; the rounding up
    to a power of two is done on its bits (no log2/ceil).

    Args:
        amax: fp32 tensor, the largest ``|x|`` of each token (non-negative,
            finite).

    Returns:
        fp32 tensor of power-of-two scales.
    """
    m = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    # m is a positive normal fp32 below 2**120. Adding 0x7FFFFF carries into
    # the exponent iff any mantissa bit is set; masking keeps the exponent.
    b = m.to(tl.int32, bitcast=True)
    return ((b + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def pow2_ceil(m):
    """The smallest power of two ``>= m``, for positive normal fp32 ``m`` (exact, on the bits).

    Adding ``0x7FFFFF`` to the bits carries into the exponent iff a mantissa bit
    is set; masking then keeps the exponent. ``m`` must be below ``2**127``.

    Args:
        m: fp32 tensor of positive normal values.

    Returns:
        fp32 tensor of powers of two.
    """
    b = m.to(tl.int32, bitcast=True)
    return ((b + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def pow2_recip(s):
    """``1 / s`` for powers of two ``s`` in ``[2**-126, 2**126]`` (exact, on the bits).

    With a power-of-two scale, ``x * pow2_recip(s)`` equals the IEEE quotient
    ``x / s`` for every fp32 ``x``: both are the correctly rounded value of the same
    real number (also when it lands in the fp32 subnormal range).

    Args:
        s: fp32 tensor of powers of two.

    Returns:
        fp32 tensor of their reciprocals.
    """
    return (0x7F000000 - s.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def mla_tile_scale_pow2(amax):
    """Power-of-two main-KV tile scale: the smallest ``2**k >= max(amax / 448, 1e-4)``.

    The floor applies to the quotient (an IEEE round-to-nearest division), the
    rule of vLLM >= 0.33 and FlashMLA. The scale lies in ``[2**-13, 2**120]``.

    Args:
        amax: fp32 tensor, the largest ``|x|`` of each tile (non-negative, finite).

    Returns:
        fp32 tensor of power-of-two scales.
    """
    return pow2_ceil(tl.maximum(tl.math.div_rn(amax, 448.0), 1e-4))


@triton.jit
def indexer_scale_fp32(amax):
    """Plain fp32 indexer scale ``max(amax, 1e-4) / 448`` (IEEE division, not rounded up).

    Args:
        amax: fp32 tensor, the largest ``|x|`` of each token (non-negative).

    Returns:
        fp32 tensor of scales.
    """
    return tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)


@triton.jit
def e8m0_word(s):
    """The 4-byte mxfp8 scale field of power-of-two scales: the E8M0 byte four times.

    The E8M0 byte of ``2**k`` is its biased fp32 exponent ``k + 127``.

    Args:
        s: fp32 tensor of positive normal powers of two.

    Returns:
        int32 tensor; its little-endian bytes are the exponent byte, four times.
    """
    e = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # e * 0x01010101 may exceed 2**31 (e >= 128): compute the word in 64 bits, then
    # keep its low 32 (the two's-complement int32 of the same bytes).
    w = e.to(tl.int64) * 0x01010101
    return (w - ((w >> 31) << 32)).to(tl.int32)


if mode.kernels_interpreted():
    # The interpreter's float8 cast is wrong (see the module docstring): keep the
    # integer emulation, which is exact everywhere.
    to_e4m3 = e4m3_bits
else:

    @triton.jit
    def to_e4m3(x):
        """fp32 -> e4m3fn bit patterns with the hardware conversion (``cvt.rn.satfinite``).

        Equal to :func:`e4m3_bits` for every non-NaN fp32 input (the GPU suite checks
        all 2**32 bit patterns); a NaN input gives a NaN code.
        """
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
