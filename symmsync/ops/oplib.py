"""The one registration of every symmsync torch op (a schema, a kernel per device, a fake),
and the one reader of the frame Dynamo is tracing.

A compiled graph calls symmsync through ops in the ``symmsync`` namespace
(:mod:`symmsync.collectives.torch_ops`, :mod:`symmsync.pcp.torch_ops`, :mod:`symmsync.moe.torch_ops`,
:mod:`symmsync.ops.fence_op`). Each is registered here the way torch's own C++ ops and vLLM's
``direct_register_custom_op`` are: ``Library.define`` with its schema, ``Library.impl`` of
one Python function for the ``CPU`` and ``CUDA`` keys, and a fake for tracing. A call of
such an op is one pass through the dispatcher into that function. ``torch.library.custom_op``
would put its Python autograd wrapper, a redispatch and an aliasing check in front of every
call, several times the cost of the call's own launch (docs/performance.md, "Host cost per
call"). None of symmsync's ops has a derivative: where torch's autograd fallback would only
warn at a backward, the ops' bodies refuse an input that requires grad while grad mode is on
(:class:`~symmsync.InputError`, the eager calls' own check).

Every op is side-effecting (``torch.fx.node.has_side_effect``): its members wait for it, so no
compiler may drop it when its outputs go unused.

The fakes that check the graph traced so far (:func:`symmsync.ops.fence_op.plain_writes`) and the
writer's choice of op by backend (:func:`backend_runs_in_order`) read the frame Dynamo is
tracing: :func:`tracer`, the one place that reads it. It is Dynamo's private state, which moves
between torch releases; so is the frame callback that :func:`symmsync.backends.compiling` reads
(whether a function runs under ``torch.compile`` at all), the one other read of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import ConfigError

#: The ``symmsync`` namespace's library (its ops live as long as the process).
LIBRARY = torch.library.Library("symmsync", "DEF")

_KEYS = ("CPU", "CUDA")  # where symmsync's memory lives: the host backend's and the GPUs'


#: The libraries of the users' namespaces (:func:`define_op`), by namespace.
_LIBRARIES: dict[str, torch.library.Library] = {"symmsync": LIBRARY}


def define(name: str, schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Register ``symmsync::<name><schema>`` (:func:`define_op` in symmsync's own namespace)."""
    return define_op(f"symmsync::{name}", schema, impl, fake)


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Register a consumer's torch op, ``namespace::name``, the way symmsync registers its own.

    ``Library.define`` with ``schema``, ``Library.impl`` of ``impl`` for CPU and CUDA tensors, and
    ``fake`` for tracing; the op is marked side-effecting (``torch.fx.node.has_side_effect``), so
    that no compiler drops a call whose outputs go unused: the members of a consumer wait for
    each other's calls, and a call dropped on one member would leave the others waiting out their
    budget. One pass through the dispatcher per call (no ``custom_op`` wrapper).

    Args:
        qualname: ``"namespace::name"`` (a namespace of your own, such as ``"mylib::all_to_all"``).
        schema: the op's arguments and results, ``"(Tensor x, int handle) -> Tensor"``. Name the
            consumer by its ``op_handle`` (an int: a graph holds no Python object).
        impl: the op's body (the consumer's eager call, looked up with ``Consumer.from_handle``).
        fake: what the op returns while tracing (new tensors of the right shapes).

    Returns:
        The op's overload (``torch.ops.namespace.name.default``), what a call site calls.

    Example::

        all_to_all_op = ss.define_op(
            "mylib::all_to_all", "(Tensor x, int handle) -> Tensor",
            lambda x, handle: AllToAll.from_handle(handle).eager(x),
            lambda x, handle: torch.empty_like(x),
        )
    """
    namespace, sep, name = qualname.partition("::")
    if not sep or not namespace.isidentifier() or not name.isidentifier():
        raise ConfigError(f"define_op: qualname must be 'namespace::name', got {qualname!r}")
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    for key in _KEYS:
        lib.impl(name, impl, key)
    torch.library.register_fake(qualname, fake, lib=lib)
    op = getattr(getattr(torch.ops, namespace), name).default
    torch.fx.node.has_side_effect(op)
    return op


def tracer():
    """The frame Dynamo is tracing now (its ``InstructionTranslator``: the graph so far is
    ``tracer().output.graph``, the backend ``tracer().output.compiler_fn``), or ``None`` outside
    Dynamo's trace (the passes after it). Import-light: Dynamo is loaded already when it traces."""
    from torch._dynamo import symbolic_convert

    tx = getattr(getattr(symbolic_convert, "tls", None), "current_tx", None)  # InstructionTranslator.current_tx()
    return tx if isinstance(tx, symbolic_convert.InstructionTranslator) else None


# Dynamo calls it while tracing and keeps the answer in the graph; no guard is needed, since
# Dynamo reuses a graph only under the backend it was traced for.
@torch.compiler.assume_constant_result
def backend_runs_in_order() -> bool:
    """Whether the graph Dynamo traces now goes to ``aot_eager`` (unwrapped from Dynamo's wrappers):
    the one backend that runs a graph's nodes in their traced order, with no reinplacing, reordering
    or merging (the direct-KV writer's op for it declares nothing mutated: :mod:`symmsync.pcp.torch_ops`)."""
    from torch._dynamo.backends.registry import lookup_backend

    tx = tracer()
    backend = tx.output.compiler_fn if tx is not None else None
    for _ in range(8):  # torch.compile's wrapper, Dynamo's debug wrapper: each holds the next
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
        if inner is None:
            break
        backend = inner
    return backend is not None and backend is lookup_backend("aot_eager")
