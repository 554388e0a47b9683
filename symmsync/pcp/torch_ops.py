"""The direct-KV writer's write as a torch custom op, for code compiled with ``torch.compile``.

:meth:`DirectKVWriter.write` calls ``torch.ops.symmsync.kv_write`` while Dynamo traces
(``torch.compiler.is_compiling()``); eager calls never reach it. Schema::

    symmsync::kv_write(int handle, int layer, Tensor kv_c, Tensor k_pe, Tensor indexer_k,
                       Tensor slots, Tensor(a!) cache) -> ()

``handle`` names the writer (:mod:`symmsync.handles`); ``slots`` is the ``slots`` tensor of
the batch the writer's ``prepare()`` returned last (prepare is collective and checks the
values: call it outside the compiled code, once per batch); ``cache`` is the ``uint8``
span of this rank's memory that holds ``layer``'s caches, declared mutated so that the
compiler orders reads of them (:meth:`DirectKVWriter.caches`, views of the same memory)
after the write. One tensor, not one per cache: Inductor reinplaced only the first of two
mutated views of one storage, and ran the op on a clone of the second.

Functionalization runs a mutating op through ``auto_functionalized``: Inductor reinplaces
it (the op gets the caches themselves), other backends (``aot_eager``) run it on clones
and copy them back at the end of the graph, over bytes the peers wrote meanwhile. The
kernel writes the real caches through its pointer tables, so the op refuses clones: it
raises :class:`~symmsync.ConfigError` before writing anything, after aborting the view so
the members raise too.
"""

from __future__ import annotations

import torch

from .. import handles
from ..checks import require
from ..errors import ConfigError
from .writer import DirectKVWriter

#: The refusal of a write on cloned caches (what to do instead).
CLONED = (
    "layer {layer}: the compiled graph passed copies of the caches (functionalization ran the "
    "symmsync::kv_write op on clones: the aot_eager backend, or Inductor without reinplacing), and "
    "copying them back at the end of the graph would overwrite the bytes peers wrote meanwhile. "
    "Compile with Inductor (the default backend), split the graph at symmsync::kv_write (vLLM's "
    "splitting_ops) so that it runs between compiled pieces, or call write() outside compiled code"
)


@torch.library.custom_op("symmsync::kv_write", mutates_args=("cache",))
def kv_write(
    handle: int,
    layer: int,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    indexer_k: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor,
) -> None:
    """Write ``layer`` of the batch whose slots are ``slots`` with the writer ``handle`` names."""
    writer = handles.lookup(handle, DirectKVWriter)
    problem = None
    if type(layer) is int and 0 <= layer < writer.layout.num_layers:  # else write() raises the layout's error
        if cache.data_ptr() != writer._spans[layer].data_ptr():
            problem = CLONED.format(layer=layer)
    batch = writer._last_batch() if writer._last_batch is not None else None
    if problem is None and (batch is None or batch.slots.data_ptr() != slots.data_ptr() or batch.rows != len(slots)):
        problem = "a compiled write() takes the Batch that this writer's prepare() returned last (once per batch)"
    if problem is not None:
        try:
            require(problem, rank=writer.buffer.rank, call="DirectKVWriter.write (compiled)")
        except ConfigError as e:
            writer.fence.abort(str(e))  # the members may already wait in this layer's fence
            raise
    writer.write(layer, kv_c, k_pe, indexer_k, batch)


@kv_write.register_fake
def _(handle, layer, kv_c, k_pe, indexer_k, slots, cache) -> None:
    return None
