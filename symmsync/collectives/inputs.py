"""What a collective's call must be, on one member: the one statement of a valid call on the host.

Every call runs these checks first (cheap when the arguments are right: the common case is one
expression, a sentence only for a problem); a problem refuses the call on every member
(:meth:`symmsync.Consumer.refuse`). Whether the members' calls agree is the kernel's check (the
consumer kit's call header; :mod:`.mismatch` words its error). ``accepts()`` asks the same.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import number_problem
from . import layout as L

MAX_HIDDEN = 16384
"""The longest row (``x.shape[-1]``) the fused epilogue takes: one program holds a row."""
# Why a fused call's tensor has the shape it must have, in its refusal.
_SHAPE_NOTES = {
    "residual": " (x's)",
    "norm_weight": " (x.shape[-1:])",
    "residual_out": " (x's)",
    "out": " (x's)",
}


def call_problem(op: Any, x: Any, out: Any) -> str | None:
    """What is wrong with a call's tensors on this member, or ``None``: the one statement of
    a valid call on the host, cheap when it is right (it runs on every call).

    ``x``: a contiguous tensor of one of the workspace's dtypes on the buffer's device, of
    at most the workspace's elements (a reduce-scatter's: a multiple of the view's size),
    that needs no gradient (grad mode off, or it does not require grad).
    ``out`` (``None``: the call makes it): a contiguous tensor of ``x``'s dtype and device,
    of the operation's ``out_numel`` elements. Whether the members' calls agree is the kernel's check
    (their headers; :mod:`.mismatch` words its error).
    """
    dev = op.device_index
    # The common case in one expression (it runs on every call); a sentence only for a problem.
    if not (
        isinstance(x, torch.Tensor)
        and x.dtype in op._limits
        and x.get_device() == dev
        and (dev >= 0 or x.is_cpu)
        and x.is_contiguous()
        and not (x.requires_grad and torch.is_grad_enabled())
    ):
        return op.tensor_problem("x", x, dtype=tuple(op._limits))
    numel = x.numel()
    limit = op._limits[x.dtype]
    if numel > limit:
        return (
            f"x has {numel} elements, more than the {limit} {x.dtype} elements the workspace holds "
            f"(max_numel={op.max_numel} of {op.dtype})"
        )
    if op._OP == L.REDUCE_SCATTER and numel % op.size:
        return f"x has {numel} elements, not a multiple of the view's {op.size} members"
    if out is None:
        return None
    return op.tensor_problem("out", out, dtype=x.dtype, numel=op.out_numel(numel))


def fused_problem(
    op: Any, x: Any, out: Any, algorithm: Any, residual: Any, weight: Any, eps: Any, res_out: Any
) -> str | None:
    """What is wrong with a fused call's arguments on this member, or ``None`` (cheap when
    they are right: the common case is one expression)."""
    bad = call_problem(op, x, None)
    if bad is not None:
        return bad
    shape = x.shape
    if not shape or shape[-1] > MAX_HIDDEN:
        return f"the fused epilogue needs rows of 1 to {MAX_HIDDEN} elements (x.shape[-1]), got x of {tuple(shape)}"
    if (algorithm or op.algorithm) not in ("auto", "one_shot"):
        return f"the fused epilogue runs one-shot: algorithm must be 'auto' or 'one_shot', got {algorithm!r}"
    dt, dev = x.dtype, op.device_index
    if (
        out is None
        and res_out is None
        and isinstance(residual, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and residual.dtype is dt
        and weight.dtype is dt
        and residual.shape == shape
        and weight.shape == shape[-1:]
        and residual.get_device() == dev
        and weight.get_device() == dev
        and (dev >= 0 or (residual.is_cpu and weight.is_cpu))  # get_device() is -1 for meta tensors too
        and residual.is_contiguous()
        and weight.is_contiguous()
        and type(eps) is float
        and eps >= 0
        and not ((residual.requires_grad or weight.requires_grad) and torch.is_grad_enabled())
    ):
        return None
    for name, t, want in (
        ("residual", residual, tuple(shape)),
        ("norm_weight", weight, (shape[-1],)),
        ("residual_out", res_out, tuple(shape)),
        ("out", out, tuple(shape)),
    ):
        if t is None and name in ("residual_out", "out"):
            continue
        bad = op.tensor_problem(name, t, dtype=dt, shape=want, shape_note=_SHAPE_NOTES[name])
        if bad is not None:
            return bad
    return number_problem("eps", eps)
