"""float32 to float8 e4m3fn codes, bit-exact compiled and interpreted: the one home of the e4m3 rule.

The consumers that quantize to fp8 (the PCP writer's caches, :mod:`symmsync.pcp.quant`; the
MoE dispatcher's fp8 option, :mod:`symmsync.moe.kernels`) convert with :func:`to_e4m3` and take
the constants of the format from here (:data:`E4M3_MAX`, :data:`AMAX_FLOOR`).

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

Why the codes are the same on both backends
-------------------------------------------
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
"""

from __future__ import annotations

import triton
import triton.language as tl

from .core import INTERPRETED

__all__ = ["AMAX_FLOOR", "E4M3_MAX", "e4m3_bits", "to_e4m3"]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

AMAX_FLOOR = 1e-4
"""The floor of ``amax`` in the per-token scale ``max(amax, 1e-4) / 448`` (DeepSeek's indexer K,
DeepEP's fp8 activations; rounded to fp32, bits 0x38D1B717)."""


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


if INTERPRETED:
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
