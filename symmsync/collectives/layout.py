"""Where a collective keeps its bytes in every member's memory.

A collective owns one workspace in the view's buffer, at the same byte offset in every
member (``offset``, a multiple of 128). Pull model: each member leaves its input in its
own workspace and reads the others' inputs through the view's pointer table::

    offset + COUNTER   int64 arrivals                  programs of this member's launch that arrived
    offset + INPUT     input[2][capacity bytes]        copied-in inputs, by epoch parity
    + SYMMETRIC        input[capacity bytes]           the caller's own input (``input()``), no copy-in
    + REDUCED          reduced[...]                    two-shot only: this member's reduced chunk

A call's header is the consumer kit's (:mod:`symmsync.language.calls`, in memory of the
collective's own): its kind is the operation, its size words ``(numel, dtype code + 256 *
symmetric, algorithm code, epilogue)`` (``epilogue``: the row length of a fused residual + RMS
norm, 0 for none), so a call of another size, dtype, algorithm, input kind or operation is
refused on every member before a byte is summed.

Over a view that spans nodes a call's header crosses nodes with its data, as the host writes
it (:func:`header`)::

    header = [tag | op, numel, dtype code, algorithm, symmetric, number, epilogue, 0]

A launch whose grid barrier stalled writes the collective record of
:mod:`symmsync.language.records` (pinned host memory on GPUs, then it traps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import is_int
from ..errors import ConfigError
from ..language.cells import LINE, round_up

#: Words of a call's header across nodes, and its fields.
HEADER_WORDS = 8
H_TAG, H_NUMEL, H_DTYPE, H_ALGORITHM, H_SYMMETRIC, H_EPOCH, H_EPILOGUE = range(7)


def header(
    op: int, numel: int, dtype_code: int, algorithm: int, symmetric: int, epoch: int, epilogue: int
) -> list[int]:
    """A call's header across nodes as ``HEADER_WORDS`` ints (``epoch``: the call's number)."""
    words = [0] * HEADER_WORDS
    words[H_TAG], words[H_NUMEL], words[H_DTYPE], words[H_ALGORITHM] = TAG + op, numel, dtype_code, algorithm
    words[H_SYMMETRIC], words[H_EPOCH], words[H_EPILOGUE] = symmetric, epoch, epilogue
    return words


#: Byte offsets from the workspace's start.
COUNTER = 0
INPUT = COUNTER + LINE

#: word 0 of a header: ``TAG + op``, so that a header never written (zeros) matches nothing.
TAG = 0x434F_4C4C_0000  # "COLL" << 16
#: Operations.
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = 1, 2, 3
OP_NAMES = {ALL_REDUCE: "AllReduce", ALL_GATHER: "AllGather", REDUCE_SCATTER: "ReduceScatter"}

#: Algorithm codes in a header (-1: the operation has one).
ALGORITHM_CODES = {"one_shot": 0, "two_shot": 1}
ALGORITHM_NAMES = {v: k for k, v in ALGORITHM_CODES.items()}
ALGORITHMS = ("auto", *ALGORITHM_CODES)
"""The algorithms of :class:`~symmsync.collectives.AllReduce`: ``"auto"`` (:func:`symmsync.collectives.tuning.choose`
picks), then the kernel's (``"one_shot"``, ``"two_shot"``)."""

#: The element types every operation takes, and their codes in a header.
DTYPES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
DTYPE_NAMES = {v: str(k).removeprefix("torch.") for k, v in DTYPES.items()}

#: Elements a two-shot chunk is rounded up to (16-byte aligned chunks for every dtype): a member's
#: chunk is ``cdiv(numel, size)`` rounded up to it (the kernel computes it).
CHUNK_ALIGN = 64


@dataclass(frozen=True)
class Workspace:
    """The byte offsets of one collective's regions (the same in every member).

    Attributes:
        offset: where the workspace starts in the buffer's user region.
        capacity: bytes of one input slot (``max_numel`` elements of the dtype).
        input_stride: bytes from one parity's input slot to the other's.
        symmetric: offset of the symmetric input (:meth:`input` of the collectives).
        reduced: offset of the two-shot reduced chunk (0 bytes for other operations).
        nbytes: bytes of the whole workspace.
    """

    offset: int
    capacity: int
    input_stride: int
    symmetric: int
    reduced: int
    nbytes: int

    @classmethod
    def plan(cls, offset: int, max_numel: int, dtype: torch.dtype, size: int, reduced: bool) -> Workspace:
        """The workspace of ``max_numel`` elements of ``dtype`` over ``size`` members at ``offset``."""
        capacity = max_numel * dtype.itemsize
        stride = round_up(capacity, LINE)
        inputs = offset + INPUT
        symmetric = inputs + 2 * stride
        red = symmetric + stride
        # The largest chunk any call fits: cdiv(capacity / itemsize, size) elements rounded
        # up to CHUNK_ALIGN, for the smallest and the largest itemsize.
        red_bytes = round_up(-(-capacity // size) + CHUNK_ALIGN * 4, LINE) if reduced else 0
        return cls(offset, capacity, stride, symmetric, red, red + red_bytes - offset)

    @property
    def counter(self) -> int:
        """Offset of the arrival counter."""
        return self.offset + COUNTER

    @property
    def inputs(self) -> int:
        """Offset of the parity-0 input slot."""
        return self.offset + INPUT


def node_steps(op: int, max_numel: int, dtype: torch.dtype, size: int, nodes: int) -> tuple[tuple[int, int], ...]:
    """The collectives over a node view that an operation over a view of ``size`` members
    spanning ``nodes`` nodes makes (:mod:`symmsync.collectives.spanning`), in order: each
    ``(operation, max_numel)``, over ``size // nodes`` members, with ``max_numel`` elements of
    ``dtype``. Their workspaces follow one another from the collective's ``offset``.

    * all-reduce: a reduce-scatter of the input, padded to a multiple of the node's members
      (room for ``2 * m`` more elements of ``dtype``: at least ``m - 1`` of any dtype), then an
      all-gather of this member's chunk of the sum;
    * all-gather: an all-gather of the inputs of one member per node (``nodes * max_numel``);
    * reduce-scatter: a reduce-scatter of the input, its chunks reordered.
    """
    m = size // nodes
    if op == ALL_REDUCE:
        padded = max_numel + 2 * m
        return ((REDUCE_SCATTER, padded), (ALL_GATHER, -(-padded // m)))
    if op == ALL_GATHER:
        return ((ALL_GATHER, nodes * max_numel),)
    return ((REDUCE_SCATTER, max_numel),)


def workspace_bytes(max_numel: int, dtype: torch.dtype, size: int, op: str = "all_reduce", nodes: int = 1) -> int:
    """Bytes a collective's workspace takes in every member's buffer.

    Args:
        max_numel: the largest call, in elements of ``dtype``.
        dtype: the element type the collective is built for.
        size: members of the view.
        op: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"`` (only the
            all-reduce keeps a reduced chunk for its two-shot algorithm).
        nodes: the nodes the view's members span (as many members on each); 1: a view within
            one node. Over several, the workspace holds the node steps' (:func:`node_steps`):
            about ``3 C`` for a reduce-scatter or ``3 C (1 + 1 / m)`` for an all-reduce, with ``C``
            the call's bytes and ``m`` the members per node; ``3 C nodes`` for an all-gather.

    Raises:
        ConfigError: ``nodes`` is not a positive divisor of ``size``.
    """
    code = {"all_reduce": ALL_REDUCE, "all_gather": ALL_GATHER, "reduce_scatter": REDUCE_SCATTER}.get(op)
    if code is None:
        raise ConfigError(f"workspace_bytes: op must be 'all_reduce', 'all_gather' or 'reduce_scatter', got {op!r}")
    if not is_int(nodes) or nodes <= 0 or not is_int(size) or size % nodes:
        raise ConfigError(f"workspace_bytes: nodes={nodes!r} must be a positive divisor of size={size!r}")
    if nodes == 1:
        return Workspace.plan(0, max_numel, dtype, size, reduced=code == ALL_REDUCE).nbytes
    m = size // nodes
    return sum(
        Workspace.plan(0, n, dtype, m, reduced=False).nbytes for _, n in node_steps(code, max_numel, dtype, size, nodes)
    )
