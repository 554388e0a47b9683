"""Expert-parallel dispatch and combine for mixture-of-experts decode.

Built only on symmsync's public API (like :mod:`symmsync.pcp` and :mod:`symmsync.collectives`):
a buffer's peer view, a :class:`~symmsync.Signals` object (counted, replay-safe waits), the
device primitives of :mod:`symmsync.language` and the agreement of
:mod:`symmsync.core.agreement`::

    from symmsync import moe

    buf = ss.SymmetricBuffer(moe.buffer_bytes(E, M, hidden, torch.bfloat16, top_k, world))
    disp = moe.Dispatcher(buf.view(list(range(world))), E, M, hidden, torch.bfloat16, top_k)
    recv, counts, handle = disp.dispatch(x, topk_idx)      # rows for this member's experts
    y = disp.combine(expert_out, topk_weights, handle)      # [tokens, hidden]

A dispatch moves each row once: its senders learn every member's counts first, then store the
row straight into its packed place, where the receiver's ``recv`` is a view (:mod:`.protocol`).
Deterministic by contract: a received row's place is fixed by (source member, token index,
expert) and the combine sums a token's contributions in float32 in the order of its top-k
entries, so every run gives the same bits (docs/moe.md states the order).
"""

from . import torch_ops as _torch_ops  # noqa: F401 - registers the symmsync:: ops of the dispatcher
from .dispatcher import MAX_TOP_K, Dispatcher, Handle, Pending, StepMismatch
from .layout import FP8_RULE, Workspace, buffer_bytes

__all__ = ["FP8_RULE", "MAX_TOP_K", "Dispatcher", "Handle", "Pending", "StepMismatch", "Workspace", "buffer_bytes"]
