"""Where a :class:`~symmsync.moe.Dispatcher` keeps its bytes in every member's memory.

A dispatcher owns one workspace in the view's buffer, at the same byte offset in every
member (``offset``, a multiple of 128). Push model: a sender stores its rows into the
receiver's workspace through the view's pointer table, straight into their packed places,
so each member's workspace holds what the others sent it, as the dispatch returns it::

    dispatch[b], b = 0, 1                     (what this member's local experts receive; b chosen
                                               by the host: the dispatcher's dispatches modulo 2)
      rows     [EL][W * M] rows of `hidden` elements (fp8: `hidden` e4m3 bytes): recv, packed
      scales   [EL][W * M][hidden / 128] float32      (fp8 only)
      src      [EL][W * M] int64: t * top_k + k of the row at its source (token t, entry k)
    counts[q], q = 0, 1                       (q: the step's number modulo 2, counted on the device)
      [W][E] int64: counts[s][e], the rows member s sends expert e (every member's, for every expert)
    combine[q], q = 0, 1                      (what this member's tokens get back)
      rows     [M][top_k] rows of `hidden` elements of the dispatcher's dtype

A dispatch's ``recv`` (its scales) and its handle's ``src`` are views of ``dispatch[b]``: the
rows move once, from the sender's tokens to their packed places (:mod:`.protocol`). Two copies by
the host's count, so that a dispatch's outputs outlive the next dispatch (its handle can wait for
a combine after it); two copies of the counts and the combine's rows by the device's count, so
that a step's stores never land where a member may still read the previous step's.

(A step's header, its refusal and its outcome are the consumer kit's, in memory of the
dispatcher's own: :mod:`symmsync.language.calls`.)

``EL`` = local experts (``num_experts // W``), ``E`` = ``num_experts``, ``W`` = members,
``M`` = ``max_tokens``. Every region starts on a line of 128 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..language.cells import LINE, round_up

#: The element types a dispatcher takes (its tokens' and its experts' outputs).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Channels per scale of the fp8 option (the per-128-channel rule of DeepSeek-style models).
FP8_GROUP = 128
FP8_RULE = (
    "s = max(amax, 1e-4) / 448 (IEEE float32 division), amax the largest |x| of each 128 channels "
    "of a token (x widened to float32); codes = e4m3fn(x / s), IEEE division, round to nearest even, "
    "saturating at +-448"
)
"""The fp8 option's quantization rule in words (a scale per token and 128 channels); its numbers and
the conversion are :mod:`symmsync.language.e4m3`'s (``AMAX_FLOOR``, ``E4M3_MAX``, ``to_e4m3``)."""


@dataclass(frozen=True)
class Workspace:
    """The byte offsets of one dispatcher's regions (the same in every member).

    Attributes:
        offset: where the workspace starts in the buffer's user region.
        rows, scales, src: buffer 0's dispatch regions (``scales`` 0 bytes without fp8).
        dispatch_stride: bytes from buffer 0's dispatch regions to buffer 1's.
        counts: parity 0's counts.
        counts_stride: bytes from parity 0's counts to parity 1's.
        combine: parity 0's combine rows.
        combine_stride: bytes from parity 0's combine rows to parity 1's.
        row_bytes: bytes of one dispatched row (its scales apart).
        nbytes: bytes of the whole workspace.
    """

    offset: int
    rows: int
    scales: int
    src: int
    dispatch_stride: int
    counts: int
    counts_stride: int
    combine: int
    combine_stride: int
    row_bytes: int
    nbytes: int

    @classmethod
    def plan(
        cls,
        offset: int,
        num_experts: int,
        size: int,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype,
        top_k: int,
        fp8: bool,
    ) -> Workspace:
        """The workspace of a dispatcher with these arguments over ``size`` members at ``offset``."""
        rows_per_member = (num_experts // size) * size * max_tokens  # EL * W * M
        row_bytes = hidden if fp8 else hidden * dtype.itemsize
        rows = offset
        scales = rows + round_up(rows_per_member * row_bytes, LINE)
        src = scales + (round_up(rows_per_member * (hidden // FP8_GROUP) * 4, LINE) if fp8 else 0)
        dispatch_stride = src + round_up(rows_per_member * 8, LINE) - rows
        counts = rows + 2 * dispatch_stride
        counts_stride = round_up(size * num_experts * 8, LINE)
        combine = counts + 2 * counts_stride
        combine_stride = round_up(max_tokens * top_k * hidden * dtype.itemsize, LINE)
        end = combine + 2 * combine_stride
        regions = (rows, scales, src, dispatch_stride, counts, counts_stride, combine, combine_stride)
        return cls(offset, *regions, row_bytes, end - offset)


def buffer_bytes(
    num_experts: int,
    max_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    top_k: int,
    size: int,
    *,
    fp8: bool = False,
) -> int:
    """Bytes a dispatcher's workspace takes in every member's buffer (the sizing rule).

    About ``2 (E M h b + M k h c)`` bytes: two copies of the rows every local expert may
    receive from every member (``E`` experts in all, ``M`` = ``max_tokens``, ``h`` = ``hidden``,
    ``b`` bytes a row element takes: the dtype's, or 1 + 4/128 with fp8) and of the rows this
    member's tokens get back (``k`` = ``top_k``, ``c`` the dtype's bytes), plus 8 bytes per
    received row (its source index) and, twice, 8 per (member, expert) (the counts), each region
    rounded up to 128 bytes.
    The sizes are those of the arguments of :class:`~symmsync.moe.Dispatcher` (``size``: the
    view's members). (Its call headers and signal slots live in memory of its own, apart.)
    """
    return Workspace.plan(0, num_experts, size, max_tokens, hidden, dtype, top_k, fp8).nbytes
