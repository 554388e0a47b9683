"""bfloat16 to and from float32 on the bits, exact compiled and interpreted: the one home of
these conversions.

Triton's interpreter runs kernels on numpy, which has no bfloat16, and its own bfloat16
conversion gets subnormals wrong (3.6 through 3.9: bits ``0x0001`` become 0, ``0x003C`` about
1.03e-38 instead of 5.5e-39). So the consumers' kernels convert on the bits, which every
backend computes alike:

* :func:`bf16_to_f32`: a bfloat16 tensor widened to float32 (the PCP writer's inputs);
* :func:`to_f32` and :func:`from_f32`: bfloat16 passed to the kernel as its int16 bits
  (``BF16_BITS``; the collectives' and the MoE dispatcher's elements under the interpreter),
  widened to float32 for a sum or a scale, and rounded back to the nearest even bfloat16 as
  torch rounds; other float types go through Triton's own conversion.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_to_f32", "to_f32", "from_f32"]


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
def to_f32(v, BF16_BITS: tl.constexpr):
    """``v`` widened to float32: bfloat16 travelling as its int16 bits (``BF16_BITS``, exact: the
    upper half of a float32), else any float type converted by Triton."""
    if BF16_BITS:
        f = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        f = v.to(tl.float32)
    return f


@triton.jit
def from_f32(acc, ELEM: tl.constexpr, BF16_BITS: tl.constexpr):
    """float32 ``acc`` rounded to the element type: bfloat16 as its int16 bits (``BF16_BITS``:
    round to nearest even, NaN to ``0x7FC0``, as torch rounds), else converted to ``ELEM``."""
    if BF16_BITS:
        # float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (as torch).
        u = acc.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
        r = tl.where(acc != acc, 0x7FC0, r)
        v = tl.where(r >= 32768, r - 65536, r).to(tl.int16)
    else:
        v = acc.to(ELEM)
    return v
