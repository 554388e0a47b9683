"""A prefill batch as the writer takes it, and a write's inputs against it.

:meth:`symmsync.pcp.DirectKVWriter.prepare` runs the checks that need the slot values
(:func:`slots_problem`), agrees on the row count among the PCP group, and returns a
:class:`Batch`, which every layer's ``write()`` then trusts; each ``write()`` checks its tensors
against it (:func:`write_problem`). The block geometry a slot must lie in (:func:`usable_blocks`)
follows the layout's placement and the buffer's mapped size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.launch import BoundLaunch
from ..errors import InputError
from .kernels import IDX, NOPE, ROPE
from .layout import IndexerKLayout, MainKVLayout

_BF16 = torch.bfloat16


@dataclass
class Batch:
    """One prefill batch as agreed by every rank: the local slot mapping, validated once.

    A runtime computes its slot mapping once per batch and reuses it for every layer,
    so the checks that need the values (range, duplicates) and the rank consensus
    happen here, not per layer. :meth:`DirectKVWriter.write <symmsync.pcp.DirectKVWriter.write>`
    takes only a batch that the same writer's ``prepare()`` returned, and trusts its slots: do
    not modify them in place.
    """

    slots: torch.Tensor  #: int64 [rows] local slot mapping (-1: padding)
    rows: int
    gathered_slots: torch.Tensor | None = None  #: the slots of the rows gathered (routes.Gather's order)
    #: The writer whose prepare() made it.
    writer: Any = field(default=None, repr=False, compare=False)
    # Made once per batch and reused by every layer's write(): the packed launch, and the
    # gathered routes' staging tensors (symmsync.pcp.gathered).
    _bound: BoundLaunch | None = field(default=None, repr=False, compare=False)
    _grid: tuple[int, int, int] = field(default=(1, 1, 1), repr=False, compare=False)
    _packed: tuple[torch.Tensor, ...] | None = field(default=None, repr=False, compare=False)
    _gathered: tuple[torch.Tensor, ...] | None = field(default=None, repr=False, compare=False)
    _header: torch.Tensor | None = field(default=None, repr=False, compare=False)  # packed's header word


#: The refusal of a compiled write on cloned caches (what to do instead).
CLONED = (
    "layer {layer}: the compiled graph passed copies of the caches (functionalization ran the "
    "symmsync::kv_write op on clones: a backend that runs aot_autograd without reinplacing, such as "
    "aot_eager_decomp_partition or Inductor with reinplacing off), and copying them back at the end of "
    "the graph would overwrite the bytes peers wrote meanwhile. Compile with Inductor (the default "
    "backend) or aot_eager, split the graph at symmsync::kv_write (vLLM's splitting_ops) so that it runs "
    "between compiled pieces, or call write() outside compiled code"
)


def slots_problem(slot_mapping: Any, device: torch.device, layout: Any, usable: int, nbytes: int) -> tuple:
    """``(slots, problem)``: this rank's slot mapping as int64 (``None`` where it is no mapping),
    and what is wrong with it, or ``None``: a 1-D int32/int64 tensor on ``device`` whose slots lie
    in ``[-1, layout.num_slots)`` and in the ``usable`` blocks mapped in the buffer's ``nbytes``."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        return None, "slot_mapping must be a 1-D tensor"
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        return None, f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}"
    if slot_mapping.device != device:
        return None, f"slot_mapping is on {slot_mapping.device}, the buffer on {device}"
    slots = slot_mapping.to(torch.int64).contiguous()
    if not slots.numel():
        return slots, None
    lo, hi = int(slots.min()), int(slots.max())
    n = layout.num_slots
    if lo < -1 or hi >= n:
        bad = lo if lo < -1 else hi
        return slots, f"slot {bad} is outside [-1, {n}) (the cache has {layout.num_blocks} blocks)"
    if hi // layout.block_size >= usable:
        return slots, (
            f"slot {hi} lies in block {hi // layout.block_size}, past the {usable} blocks of every layer "
            f"inside the buffer's {nbytes} bytes: grow the buffer first"
        )
    return slots, None


def check_duplicates(members: Sequence[int], mappings: Sequence[torch.Tensor]) -> None:
    """Raise :class:`~symmsync.InputError` for a slot two members of the PCP group write (every rank
    checks its own group from the mappings its members sent: ``debug=True``)."""
    seen: dict[int, int] = {}
    for r, mapping in zip(members, mappings):
        for s in mapping.tolist():
            if s < 0:
                continue
            if s in seen:
                raise InputError(
                    f"DirectKVWriter.prepare (debug): slot {s} is written by rank {seen[s]} and "
                    f"rank {r} of the PCP group {list(members)}; each token needs one owner"
                )
            seen[s] = r


def usable_blocks(layout: Any, offsets: Sequence[tuple[int, int]], strides: tuple[int, int], nbytes: int) -> int:
    """Blocks of every layer that lie inside ``nbytes`` of the buffer (``offsets``: each layer's
    main-KV and indexer-K offsets; ``strides``: bytes from one block to the next of each)."""
    bs = layout.block_size
    widths = (bs * MainKVLayout.TOKEN_BYTES, bs * IndexerKLayout.TOKEN_BYTES)
    n = layout.num_blocks
    for pair in offsets:
        for off, stride, width in zip(pair, strides, widths):
            n = min(n, max(0, (nbytes - off - width) // stride + 1))
    return n


def write_problem(writer: Any, layer: Any, kv_c: Any, k_pe: Any, indexer_k: Any, batch: Any) -> tuple | None:
    """What is wrong with ``writer.write()``'s arguments, and the error it raises, or ``None``.

    The one check of a write's inputs, cheap when they are right (it runs on every layer):
    identity and attribute tests first, sentences only for a problem (the layout's for ``layer``,
    the consumer kit's tensor rule, :meth:`symmsync.Consumer.tensor_problem`, for the tensors).
    """
    if type(layer) is not int or not 0 <= layer < writer.layout.num_layers:
        bad = writer.layout.layer_problem(layer)  # the layout's own check and error
        if bad is not None:
            return bad
    if type(batch) is not Batch or batch.writer is not writer:
        return InputError, (
            "pass the Batch returned by this writer's prepare() (its slots were checked against this writer's layout)"
        )
    rows = batch.rows
    dev = writer.device_index
    # The common case in one expression (no call per tensor: this runs per layer). get_device()
    # is -1 for CPU tensors and for meta tensors too: on the host backend, CPU is asked apart.
    if (
        isinstance(kv_c, torch.Tensor)
        and isinstance(k_pe, torch.Tensor)
        and isinstance(indexer_k, torch.Tensor)
        and kv_c.dtype is _BF16
        and k_pe.dtype is _BF16
        and indexer_k.dtype is _BF16
        and kv_c.shape == (rows, NOPE)
        and k_pe.shape == (rows, ROPE)
        and indexer_k.shape == (rows, IDX)
        and kv_c.get_device() == dev
        and k_pe.get_device() == dev
        and indexer_k.get_device() == dev
        and kv_c.is_contiguous()
        and k_pe.is_contiguous()
        and indexer_k.is_contiguous()
        and (dev >= 0 or (kv_c.is_cpu and k_pe.is_cpu and indexer_k.is_cpu))
        and not ((kv_c.requires_grad or k_pe.requires_grad or indexer_k.requires_grad) and torch.is_grad_enabled())
    ):
        return None
    for name, t, width in (("kv_c", kv_c, NOPE), ("k_pe", k_pe, ROPE), ("indexer_k", indexer_k, IDX)):
        bad = writer.tensor_problem(
            name, t, dtype=_BF16, shape=(rows, width), shape_note=" to match the batch's slot mapping"
        )
        if bad is not None:
            return InputError, bad
    return None
