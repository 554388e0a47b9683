"""The one registration of every symmsync torch op: a schema, a kernel per device, a fake.

A compiled graph calls symmsync through ops in the ``symmsync`` namespace
(:mod:`symmsync.collectives.torch_ops`, :mod:`symmsync.pcp.torch_ops`,
:mod:`symmsync.fence_ops`). Each is registered here the way torch's own C++ ops and vLLM's
``direct_register_custom_op`` are: ``Library.define`` with its schema, ``Library.impl`` of
one Python function for the ``CPU`` and ``CUDA`` keys, and a fake for tracing. A call of
such an op is one pass through the dispatcher into that function. ``torch.library.custom_op``
would put its Python autograd wrapper, a redispatch and an aliasing check in front of every
call, several times the cost of the call's own launch (docs/performance.md, "Host cost per
call"); none of symmsync's ops has a derivative, so torch's autograd fallback stands in for
the wrapper (an input that requires grad warns if a backward reaches it).

Every op is side-effecting (``torch.fx.node.has_side_effect``): its members wait for it, so no
compiler may drop it when its outputs go unused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The ``symmsync`` namespace's library (its ops live as long as the process).
LIBRARY = torch.library.Library("symmsync", "DEF")

_KEYS = ("CPU", "CUDA")  # where symmsync's memory lives: the host backend's and the GPUs'


def define(name: str, schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Register ``symmsync::<name><schema>`` with ``impl`` for CPU and CUDA tensors and ``fake`` for
    tracing, marked side-effecting; return its overload (what a call site calls)."""
    LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    for key in _KEYS:
        LIBRARY.impl(name, impl, key)
    torch.library.register_fake(f"symmsync::{name}", fake, lib=LIBRARY)
    op = getattr(torch.ops.symmsync, name).default
    torch.fx.node.has_side_effect(op)
    return op
