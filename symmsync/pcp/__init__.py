"""Prefill context parallelism: the direct-KV cache writer, symmsync's first consumer.

Built only on symmsync's public API: buffers, peer views and fences (their kernel
arguments, :attr:`symmsync.Fence.kernel_args`), the device primitives in
:mod:`symmsync.language`, the launcher of :mod:`symmsync.core.launch`, the agreement among
ranks of :mod:`symmsync.core.agreement`, the argument checks of :mod:`symmsync.checks`, and
:func:`symmsync.backends.mode.kernels_interpreted`::

    from symmsync import pcp

    layout = pcp.CacheLayout(num_blocks, num_layers)  # main_scale="pow2", indexer_scale="ue8m0"
    writer = pcp.DirectKVWriter(ss.pcp_view(buf, tp), layout)
    batch = writer.prepare(local_slot_mapping)        # once per batch
    for layer in range(num_layers):
        writer.write(layer, kv_c, k_pe, indexer_k, batch)
"""

from . import torch_ops as _torch_ops  # noqa: F401 - registers symmsync::kv_write and kv_write_in_order
from .layout import CacheLayout, CacheTensors, IndexerKLayout, MainKVLayout, Placement
from .quant import INDEXER_SCALES, MAIN_SCALES
from .split import PCPSplit, pcp_split
from .writer import ROUTES, Batch, DirectKVWriter, Tuning

__all__ = [
    "Batch",
    "CacheLayout",
    "CacheTensors",
    "DirectKVWriter",
    "INDEXER_SCALES",
    "IndexerKLayout",
    "MAIN_SCALES",
    "MainKVLayout",
    "PCPSplit",
    "Placement",
    "ROUTES",
    "Tuning",
    "pcp_split",
]
