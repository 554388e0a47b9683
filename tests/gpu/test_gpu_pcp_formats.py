"""The PCP cache formats on GPUs: the hardware fp8 conversion.

* The compiled writer converts to e4m3fn with the hardware instruction
  (``cvt.rn.satfinite.e4m3x2.f32``), the interpreter with the integer emulation
  :func:`symmsync.pcp.quant.e4m3_bits` (checked against torch on the host). Both give
  the same byte for every one of the 2**32 fp32 bit patterns but NaNs.
* With a power-of-two scale the writer multiplies by its (exact) reciprocal instead
  of dividing: equal for every fp32 ``x`` and every scale the formats produce.

Every format's bytes, on both routes, are checked on 2 GPUs by
tests/pcp/test_pcp_formats.py (its ``backend`` fixture runs the host case and the GPU case).
"""

import pytest
import torch
import triton
import triton.language as tl

from symmsync.backends import mode
from symmsync.pcp import quant
from symmsync.testing import run

pytestmark = pytest.mark.gpu
BLOCK = 4096


@triton.jit
def _conversion_kernel(bad, nan_bad, first, S_BITS: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    # Every fp32 bit pattern: program p takes patterns [p * BLOCK, (p + 1) * BLOCK).
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = idx.to(tl.int32).to(tl.float32, bitcast=True)  # the low 32 bits: wraps into the negatives
    is_nan = x != x
    not_nan = x == x
    if SCALED:
        # The writer's pow2 path against the IEEE quotient, for one power-of-two scale.
        s = tl.full((BLOCK,), S_BITS, tl.int32).to(tl.float32, bitcast=True)
        fast = quant.to_e4m3(x * quant.pow2_recip(s))
        slow = quant.e4m3_bits(tl.math.div_rn(x, s))
        prod_bits = (x * quant.pow2_recip(s)).to(tl.int32, bitcast=True)
        quot_bits = tl.math.div_rn(x, s).to(tl.int32, bitcast=True)
        wrong = ((fast != slow) | (prod_bits != quot_bits)) & not_nan
    else:
        fast = quant.to_e4m3(x)
        slow = quant.e4m3_bits(x)
        wrong = (fast != slow) & not_nan
    # NaN inputs must give a NaN code (0x7F or 0xFF); their sign bit is not compared.
    nan_wrong = is_nan & ((fast & 0x7F) != 0x7F)
    nw = tl.sum(wrong.to(tl.int32), axis=0)
    tl.atomic_add(bad, nw)
    tl.atomic_add(nan_bad, tl.sum(nan_wrong.to(tl.int32), axis=0))
    if nw > 0:
        tl.atomic_min(first, tl.min(tl.where(wrong, idx, 1 << 40), axis=0))


def _exhaustive(s_bits: int = 0, scaled: bool = False):
    dev = torch.device("cuda", torch.cuda.current_device())
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    nan_bad = torch.zeros(1, dtype=torch.int32, device=dev)
    first = torch.full((1,), 1 << 40, dtype=torch.int64, device=dev)
    compiled = _conversion_kernel[(2**32 // BLOCK,)](
        bad, nan_bad, first, S_BITS=s_bits, SCALED=scaled, BLOCK=BLOCK, num_warps=8
    )
    torch.cuda.synchronize()
    ptx = compiled.asm["ptx"]
    return int(bad.item()), int(nan_bad.item()), int(first.item()), "cvt.rn.satfinite.e4m3x2.f32" in ptx, ".ftz" in ptx


SCALE_EXPONENTS = (-22, -13, -8, 0, 7, 60, 119, 120)  # the formats' power-of-two scales lie in [2**-22, 2**120]


def every_pattern():
    """Runs in a rank process: this pytest process runs Triton's interpreter (conftest)."""
    assert not mode.kernels_interpreted()
    out = {"convert": _exhaustive()}
    for k in SCALE_EXPONENTS:
        out[k] = _exhaustive((k + 127) << 23, scaled=True)
    return out


@pytest.fixture(scope="module")
def patterns():
    return run(every_pattern, 1, backend="cuda", timeout_s=300)[0]


def test_hardware_conversion_equals_the_emulation_for_every_fp32_pattern(patterns):
    bad, nan_bad, first, hardware, ftz = patterns["convert"]
    assert bad == 0, f"{bad} patterns differ; first {first:#010x}"
    assert nan_bad == 0
    # The compiled path really is the hardware conversion, and nothing flushes subnormals.
    assert hardware and not ftz


@pytest.mark.parametrize("k", SCALE_EXPONENTS)
def test_multiplying_by_a_power_of_two_reciprocal_equals_dividing_for_every_fp32(patterns, k):
    bad, nan_bad, first, _, ftz = patterns[k]
    assert bad == 0, f"scale 2**{k}: {bad} patterns differ; first {first:#010x}"
    assert nan_bad == 0 and not ftz
