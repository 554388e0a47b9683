"""The direct-KV writer's write as torch custom ops, for code compiled with ``torch.compile``.

:meth:`DirectKVWriter.write` calls :func:`traced_write` while Dynamo traces
(``torch.compiler.is_compiling()``); eager calls never reach it. It puts one of two ops
in the graph, chosen by the backend the graph goes to::

    symmsync::kv_write(int handle, int layer, Tensor kv_c, Tensor k_pe, Tensor indexer_k,
                       Tensor slots, Tensor(a!) cache) -> ()
    symmsync::kv_write_in_order(int handle, int layer, Tensor kv_c, Tensor k_pe,
                                Tensor indexer_k, Tensor slots, Tensor cache,
                                Tensor[] orders) -> ()

``handle`` names the writer (:mod:`symmsync.ops.handles`); ``slots`` is the ``slots`` tensor of
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
meanwhile: the op refuses clones, raising :class:`~symmsync.ConfigError` before writing
anything, after aborting the view so that the members raise too.

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
``symmsync::fence``) lets the op's fake find them while Dynamo traces and refuse the
graph with :class:`~symmsync.ConfigError` (:data:`UNORDERED`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import is_int, require
from ..errors import ConfigError
from . import fence as fence_ops
from . import handles, oplib

#: The refusal of a write on cloned caches (what to do instead).
CLONED = (
    "layer {layer}: the compiled graph passed copies of the caches (functionalization ran the "
    "symmsync::kv_write op on clones: a backend that runs aot_autograd without reinplacing, such as "
    "aot_eager_decomp_partition or Inductor with reinplacing off), and copying them back at the end of "
    "the graph would overwrite the bytes peers wrote meanwhile. Compile with Inductor (the default "
    "backend) or aot_eager, split the graph at symmsync::kv_write (vLLM's splitting_ops) so that it runs "
    "between compiled pieces, or call write() outside compiled code"
)

#: The refusal of a graph that writes into symmetric memory before a write (aot_eager).
UNORDERED = (
    "a compiled DirectKVWriter.write (aot_eager: symmsync::kv_write_in_order) follows writes into "
    "symmetric memory (of view members {members}) in the same graph: functionalization applies a graph's "
    "writes into its inputs at the end of the graph, after the write and its fence, so they would "
    "overwrite its bytes and peers would read stale ones. Make those writes before the compiled code (or "
    "in a graph that ends before the write)"
)


def traced_write(
    writer: Any, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, indexer_k: torch.Tensor, batch: Any
) -> None:
    """What :meth:`DirectKVWriter.write` puts in the graph Dynamo traces: the op for its backend."""
    span = writer.span(layer)  # refuses a writer without caches
    if _backend_runs_in_order():
        orders = writer.fence._orders()
        return torch.ops.symmsync.kv_write_in_order(
            writer.handle, layer, kv_c, k_pe, indexer_k, batch.slots, span, orders
        )
    return torch.ops.symmsync.kv_write(writer.handle, layer, kv_c, k_pe, indexer_k, batch.slots, span)


# Dynamo calls it while tracing and keeps the answer in the graph; no guard is needed, since
# Dynamo reuses a graph only under the backend it was traced for.
@torch.compiler.assume_constant_result
def _backend_runs_in_order() -> bool:
    """Whether the graph Dynamo traces now goes to ``aot_eager`` (unwrapped from Dynamo's wrappers)."""
    from torch._dynamo.backends.registry import lookup_backend

    tx = oplib.tracer()
    backend = tx.output.compiler_fn if tx is not None else None
    for _ in range(8):  # torch.compile's wrapper, Dynamo's debug wrapper: each holds the next
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
        if inner is None:
            break
        backend = inner
    return backend is not None and backend is lookup_backend("aot_eager")


def _write(handle: int, layer: int, kv_c, k_pe, indexer_k, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """The ops' body: check that ``cache`` is the writer's span and ``slots`` its last batch's (what
    the graph cannot have checked), then the eager write's checked path."""
    writer = handles.lookup(handle, "DirectKVWriter")
    problem = None
    if is_int(layer) and 0 <= layer < writer.layout.num_layers:  # else the write raises the layout's error
        if cache.data_ptr() != writer.span(layer).data_ptr():
            problem = CLONED.format(layer=layer)
    batch = writer._last_batch() if writer._last_batch is not None else None
    stale = batch is None or batch.slots.data_ptr() != slots.data_ptr() or batch.rows != slots.shape[0]
    if problem is None and stale:
        problem = "a compiled write() takes the Batch that this writer's prepare() returned last (once per batch)"
    if problem is not None:
        try:
            require(problem, rank=writer.buffer.rank, call="DirectKVWriter.write (compiled)")
        except ConfigError as e:
            writer._abort(str(e))  # the members may already wait in this layer's fence (across nodes too)
            raise
    writer._write(layer, kv_c, k_pe, indexer_k, batch)


def _kv_write(handle, layer, kv_c, k_pe, indexer_k, slots, cache) -> None:
    _write(handle, layer, kv_c, k_pe, indexer_k, slots, cache)  # the body, looked up per call: a test's seam


def _write_in_order(handle, layer, kv_c, k_pe, indexer_k, slots, cache, orders) -> None:
    _write(handle, layer, kv_c, k_pe, indexer_k, slots, cache)


def _in_order_fake(handle, layer, kv_c, k_pe, indexer_k, slots, cache, orders) -> None:
    written = fence_ops.plain_writes(orders)
    if written:
        raise ConfigError(UNORDERED.format(members=written))


_ARGS = "SymInt handle, SymInt layer, Tensor kv_c, Tensor k_pe, Tensor indexer_k, Tensor slots"
# kv_write declares the caches it writes; kv_write_in_order declares nothing (it is never
# dropped all the same: every symmsync op is side-effecting, symmsync.ops.oplib).
oplib.define("kv_write", f"({_ARGS}, Tensor(a6!) cache) -> ()", _kv_write, lambda *args: None)
oplib.define("kv_write_in_order", f"({_ARGS}, Tensor cache, Tensor[] orders) -> ()", _write_in_order, _in_order_fake)
