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

Conversion to e4m3fn and widening of bf16
-----------------------------------------
:func:`to_e4m3` (and its integer emulation :func:`e4m3_bits`) and :func:`bf16_to_f32` are
:mod:`symmsync.language.e4m3`'s and :mod:`symmsync.language.bf16`'s, shared with the MoE
dispatcher; their docstrings say why their bits are the same compiled and interpreted. The
format's largest value (:data:`FP8_E4M3_MAX`) and the indexer's ``amax`` floor
(:data:`INDEXER_AMAX_FLOOR`) are :mod:`symmsync.language.e4m3`'s too.

Why the results are exact on both backends
------------------------------------------
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
  bits), not ``.to(tl.float32)``, which the interpreter gets wrong for subnormals.

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

from ..language.bf16 import bf16_to_f32
from ..language.e4m3 import AMAX_FLOOR, E4M3_MAX, e4m3_bits, to_e4m3

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

FP8_E4M3_MAX = E4M3_MAX
"""Largest finite float8_e4m3fn value (:data:`symmsync.language.e4m3.E4M3_MAX`)."""

FLT_MIN = 1.1754943508222875e-38
"""Smallest normal fp32 value, ``2**-126``; the floor of the MLA tile scales."""

INDEXER_AMAX_FLOOR = AMAX_FLOOR
"""Floor applied to the indexer ``amax`` (:data:`symmsync.language.e4m3.AMAX_FLOOR`)."""

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
