"""The MoE dispatcher as torch custom ops: what a graph that ``torch.compile`` traced calls.

Inside a function being compiled, ``disp.dispatch(x, topk_idx)`` and
``disp.combine(expert_out, topk_weights, handle)`` trace to these ops instead of launching::

    symmsync::moe_dispatch(Tensor x, Tensor topk_idx, int handle, int local_experts, int size,
                          int max_tokens, bool fp8)
        -> (Tensor recv, Tensor scales, Tensor counts, Tensor src, Tensor per_source, Tensor offsets)
    symmsync::moe_combine(Tensor expert_out, Tensor topk_weights, Tensor topk_idx, Tensor src,
                          Tensor per_source, Tensor offsets, int handle) -> Tensor

``handle`` names the dispatcher (its ``op_handle`` attribute, :mod:`symmsync.ops.handles`); the
dispatch op also takes the sizes its outputs' shapes depend on (local experts, members,
``max_tokens``, ``fp8``), so that its fake reads nothing from the object a handle names (a graph
cache keys a graph by its nodes and constants, not by the object). Each op runs the eager
call's checked path (:meth:`Dispatcher.eager_dispatch`, :meth:`Dispatcher.eager_combine`)
and returns no input, and no two of its returns share a storage (torch checks both): the
dispatch's ``recv``, ``scales`` and ``src`` are tensors over the dispatcher's workspace, where the
senders stored the rows (valid until its dispatch after next), each with a storage of its own; its
counts, ``per_source`` and ``offsets`` are new tensors; the combine's ``y`` is new. Marked side-effecting
(:func:`symmsync.ops.oplib.define`): the members wait for every call.
"""

import torch

from ..ops import handles, oplib
from .dispatcher import Dispatcher


def _dispatch(x, topk_idx, handle, local_experts, size, max_tokens, fp8):
    return handles.lookup(handle, Dispatcher).eager_dispatch(x, topk_idx)


def _dispatch_fake(x, topk_idx, handle, local_experts, size, max_tokens, fp8):
    rows, hidden, i64 = size * max_tokens, x.shape[-1], torch.int64
    if fp8:
        recv = x.new_empty((local_experts, rows, hidden), dtype=torch.float8_e4m3fn)
        scales = x.new_empty((local_experts, rows, hidden // 128), dtype=torch.float32)
    else:
        recv, scales = x.new_empty((local_experts, rows, hidden)), x.new_empty((0,), dtype=torch.float32)
    counts = x.new_empty((local_experts,), dtype=i64)
    return (
        recv,
        scales,
        counts,
        x.new_empty((local_experts, rows), dtype=i64),
        x.new_empty((local_experts, size), dtype=i64),
        x.new_empty((local_experts, size), dtype=i64),
    )


def _combine(expert_out, topk_weights, topk_idx, src, per_source, offsets, handle):
    disp = handles.lookup(handle, Dispatcher)
    return disp.eager_combine(expert_out, topk_weights, topk_idx, src, per_source, offsets)


def _combine_fake(expert_out, topk_weights, topk_idx, src, per_source, offsets, handle):
    return expert_out.new_empty((topk_idx.shape[0], expert_out.shape[-1]))


oplib.define(
    "moe_dispatch",
    "(Tensor x, Tensor topk_idx, int handle, int local_experts, int size, int max_tokens, bool fp8)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _dispatch,
    _dispatch_fake,
)
oplib.define(
    "moe_combine",
    "(Tensor expert_out, Tensor topk_weights, Tensor topk_idx, Tensor src, Tensor per_source, Tensor offsets, "
    "int handle) -> Tensor",
    _combine,
    _combine_fake,
)
