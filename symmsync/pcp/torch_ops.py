"""The direct-KV writer's write as torch custom ops, for code compiled with ``torch.compile``.

:meth:`DirectKVWriter.write` puts one of these ops in the graph while Dynamo traces
(``torch.compiler.is_compiling()``); eager calls never reach them. It puts one of two ops
in the graph, chosen by the backend the graph goes to::

    symmsync::kv_write(int handle, int layer, Tensor kv_c, Tensor k_pe, Tensor indexer_k,
                       Tensor slots, Tensor(a!) cache) -> ()
    symmsync::kv_write_in_order(int handle, int layer, Tensor kv_c, Tensor k_pe,
                                Tensor indexer_k, Tensor slots, Tensor cache,
                                Tensor[] orders) -> ()

``handle`` names the writer (its ``op_handle``, :mod:`symmsync.ops.handles`); ``slots`` is the ``slots`` tensor of
the batch the writer's ``prepare()`` returned last (prepare is collective and checks the
values: call it outside the compiled code, once per batch); ``cache`` is the ``uint8``
span of this rank's memory that holds ``layer``'s caches (:meth:`DirectKVWriter.caches`
are views of the same memory). Both ops write the real caches of every member through
the kernel's pointer tables, whatever tensor the graph passes.

``symmsync::kv_write`` (Inductor, and every backend other than ``aot_eager``) declares
``cache`` mutated, so that the compiler orders reads of the caches after the write.
Functionalization runs a mutating op through ``auto_functionalized``: Inductor
reinplaces it (the op gets the span itself); a graph split at the op (vLLM's
``splitting_ops``) runs it as it is. One tensor, not one per cache: Inductor reinplaced
only the first of two mutated views of one storage, and ran the op on a clone of the
second. A backend that neither reinplaces nor splits would run it on a clone and copy
the clone back at the end of the graph, over the bytes the kernel and the peers wrote
meanwhile: the op refuses clones (:meth:`DirectKVWriter.compiled_write`), raising
:class:`~symmsync.ConfigError` before writing anything, failing that write on every member
(:meth:`DirectKVWriter.refuse`).

``symmsync::kv_write_in_order`` (``aot_eager``) declares nothing mutated, so
functionalization leaves it alone (no clone, no copy back), and is registered as
side-effectful (``torch.fx.node.has_side_effect``), so no pass drops it. The reads of
the caches after it are nodes after it in the graph, and ``aot_eager`` runs the graph's
nodes in their traced order: it neither reinplaces, nor reorders, nor merges equal
reads (the partitioner that merges them, ``min_cut_rematerialization_partition`` with
its common-subexpression pass, is Inductor's, which gets ``symmsync::kv_write``). Any
other backend might do either, so it gets the declared mutation and, where that would
run on a clone, the refusal. Since nothing is declared, plain torch writes into
symmetric memory earlier in the same graph would reach memory at the end of the graph,
after the write and its fence; ``orders`` (the view members' user regions, as for
``symmsync::fence``, :mod:`symmsync.ops.fence_op`) lets the op's fake find them while Dynamo traces and refuse the
graph with :class:`~symmsync.ConfigError` (:data:`UNORDERED`).
"""

from __future__ import annotations

from ..errors import ConfigError
from ..ops import fence_op, handles, oplib
from .writer import DirectKVWriter

#: The refusal of a graph that writes into symmetric memory before a write (aot_eager).
UNORDERED = (
    "a compiled DirectKVWriter.write (aot_eager: symmsync::kv_write_in_order) follows writes into "
    "symmetric memory (of view members {members}) in the same graph: functionalization applies a graph's "
    "writes into its inputs at the end of the graph, after the write and its fence, so they would "
    "overwrite its bytes and peers would read stale ones. Make those writes before the compiled code (or "
    "in a graph that ends before the write)"
)


def _kv_write(handle, layer, kv_c, k_pe, indexer_k, slots, cache) -> None:
    handles.lookup(handle, DirectKVWriter).compiled_write(layer, kv_c, k_pe, indexer_k, slots, cache)


def _write_in_order(handle, layer, kv_c, k_pe, indexer_k, slots, cache, orders) -> None:
    handles.lookup(handle, DirectKVWriter).compiled_write(layer, kv_c, k_pe, indexer_k, slots, cache)


def _in_order_fake(handle, layer, kv_c, k_pe, indexer_k, slots, cache, orders) -> None:
    written = fence_op.plain_writes(orders)
    if written:
        raise ConfigError(UNORDERED.format(members=written))


_ARGS = "SymInt handle, SymInt layer, Tensor kv_c, Tensor k_pe, Tensor indexer_k, Tensor slots"
# kv_write declares the caches it writes; kv_write_in_order declares nothing (it is never
# dropped all the same: every symmsync op is side-effecting, symmsync.ops.oplib).
oplib.define("kv_write", f"({_ARGS}, Tensor(a6!) cache) -> ()", _kv_write, lambda *args: None)
oplib.define("kv_write_in_order", f"({_ARGS}, Tensor cache, Tensor[] orders) -> ()", _write_in_order, _in_order_fake)
