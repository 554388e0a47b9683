"""The writer's kernel and the byte geometry it writes.

:func:`_quantize_write_kernel` quantizes rows of bf16 inputs (``kv_c``, ``k_pe``,
``indexer_k``) and stores the final cache bytes of every row into each destination of a
table of base addresses: a token's main-KV bytes at ``main_off + block * main_bstride +
offset * MainKVLayout.TOKEN_BYTES`` and its indexer-K values and scale field in its block
of the indexer region (:mod:`symmsync.pcp.layout` states the bytes and the scale rules).
With ``FUSED`` its tail is a whole fence: with ``HEADER`` (within one node) the write's call
header, the fence and the verdict (:func:`symmsync.language.fence_call`: the layer and the rows
are its size words), else :func:`symmsync.language.grid_fence`. With
``GATHERED`` the rows arrived by all-gather, one block of ``per_member`` rows per member, each
block opening with a header row (slot -1) whose first int64 word is nonzero where that member
refused its write (:meth:`symmsync.pcp.DirectKVWriter.refuse`): its rows are skipped.

How the stores are shaped (the measurements: docs/performance.md, "The PCP writer on one
GPU"):

* A token's main KV goes out as three runs of 16-byte vector stores, each lane storing 16
  contiguous bytes: its codes (a warp stores a whole row), its 4 tile scales (one 16-byte
  store) and its RoPE values (copied as they are). Its indexer-K codes are one 128-byte line.
  Where slots are consecutive, neighbouring tokens' stores fill whole 128-byte lines
  between them; scattered slots and padding rows need no other path (a token's stores
  never depend on its neighbours').
* Every load of a work item (slots, the three input rows, 16 bytes per lane) is issued
  before its first store: the compiler cannot prove that inputs and caches do not
  alias, so a load after a store would wait for it. On a persistent grid
  (``PREFETCH``) a program also loads its next work item before it stores the current
  one, so that its loads stay in flight while it quantizes.

:class:`~symmsync.pcp.DirectKVWriter` launches it; nothing here checks its arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import language as ssl
from ..language.bf16 import bf16_to_f32
from ..language.e4m3 import to_e4m3
from .layout import IndexerKLayout, MainKVLayout
from .quant import (
    e8m0_word,
    indexer_scale,
    indexer_scale_fp32,
    mla_tile_scale,
    mla_tile_scale_pow2,
    pow2_recip,
)

#: Widths of a row of the inputs: kv_c, k_pe, indexer_k (bf16 values).
NOPE, ROPE, IDX = MainKVLayout.NOPE_DIM, MainKVLayout.ROPE_DIM, IndexerKLayout.DIM
#: Cache bytes of one token: main KV and indexer K.
TOKEN_BYTES = MainKVLayout.TOKEN_BYTES + IndexerKLayout.TOKEN_BYTES

# The byte geometry the kernel writes, from the layout module. Triton reads a module
# global inside a kernel only when it is a ``tl.constexpr``.
_NOPE = tl.constexpr(NOPE)  # kv_c values per row: the main-KV code bytes of a token
_ROPE = tl.constexpr(ROPE)
_IDX = tl.constexpr(IDX)  # indexer-K values per row: its code bytes
_MAIN_TOKEN = tl.constexpr(MainKVLayout.TOKEN_BYTES)  # a token's main-KV bytes
_MAIN_SCALES = tl.constexpr(MainKVLayout.SCALES_OFFSET)  # its fp32 tile scales, then its RoPE values
_TILE = tl.constexpr(MainKVLayout.TILE)  # values per main-KV tile (one scale each)
_TILES = tl.constexpr(MainKVLayout.NUM_TILES)
_IDX_SCALE = tl.constexpr(IndexerKLayout.SCALE_BYTES)  # a token's indexer scale field
# After a token's codes: its 4 fp32 tile scales (one 16-byte store), then its 64 RoPE
# values (copied as they are, never converted).
_ROPE_AT = tl.constexpr(MainKVLayout.ROPE_OFFSET)
assert MainKVLayout.ROPE_OFFSET == MainKVLayout.SCALES_OFFSET + 4 * MainKVLayout.NUM_TILES, "scales, then RoPE"
assert MainKVLayout.TOKEN_BYTES % 16 == 0 and MainKVLayout.SCALES_OFFSET % 16 == 0, "16-byte runs"
assert MainKVLayout.ROPE_OFFSET % 16 == 0 and MainKVLayout.NUM_TILES == 4, "one 16-byte store of scales"


@triton.jit
def _load_item(item, n_rows, slots, kv_c, k_pe, idx_k, kv_stride, pe_stride, ix_stride, BLOCK_T: tl.constexpr):
    """Every load of one work item: its slots and its three input rows, 16 bytes per lane.
    Rows past ``n_rows`` are masked (no memory traffic), so a program may load past its last item."""
    rows = item * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = rows < n_rows
    c_nope = tl.arange(0, _NOPE)
    c_idx = tl.arange(0, _IDX)
    c_pe = tl.arange(0, _ROPE)
    slot = tl.load(slots + rows, mask=in_range, other=-1)
    x = tl.load(kv_c + rows[:, None] * kv_stride + c_nope[None, :], mask=in_range[:, None], other=0)
    xi = tl.load(idx_k + rows[:, None] * ix_stride + c_idx[None, :], mask=in_range[:, None], other=0)
    pe = tl.load(k_pe + rows[:, None] * pe_stride + c_pe[None, :], mask=in_range[:, None], other=0)
    return slot, x, xi, pe


@triton.jit
def _quantize_write_kernel(
    kv_c,
    k_pe,
    idx_k,
    kv_stride,
    pe_stride,
    ix_stride,  # bf16 rows, read as int16 bits; strides in elements
    slots,
    n_rows,  # int64 slot of each row (-1: padding), number of rows
    dst,
    main_off,
    idx_off,  # table of destination base addresses; byte offsets of the layer's regions
    main_bstride,
    idx_bstride,  # bytes from one cache block to the next (a runtime may pad them)
    ptrs,
    cell,
    me,
    timeout_ns,
    record,  # the fence's arguments (Fence.kernel_args; FUSED only)
    calls,
    layer,
    refused,  # HEADER: the writer's call headers, the layer, this write's refusal (0: none)
    per_member,  # GATHERED: rows of each member's block (its header row, then its rows)
    NDST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FUSED: tl.constexpr,
    TRAP: tl.constexpr,
    MAIN_POW2: tl.constexpr,
    IDX_SCALE: tl.constexpr,
    SPREAD: tl.constexpr,
    PREFETCH: tl.constexpr,
    GATHERED: tl.constexpr,
    HEADER: tl.constexpr,
):
    # Each program takes work items of BLOCK_T rows until none are left: one item each on a
    # grid of one program per item, several on a smaller (persistent) grid. With PREFETCH
    # a program loads its next item before it stores the current one, so that its loads
    # stay in flight while it quantizes and stores. With SPREAD the grid's second axis
    # names the one destination a program stores to, so that programs storing to peers
    # and programs storing locally run side by side.
    NOUT: tl.constexpr = 1 if SPREAD else NDST  # destinations each program stores to
    n_items = tl.cdiv(n_rows, BLOCK_T)
    item = tl.program_id(0)
    step = tl.num_programs(0)
    c_nope = tl.arange(0, _NOPE)
    c_idx = tl.arange(0, _IDX)
    c_pe = tl.arange(0, _ROPE)
    c4 = tl.arange(0, _TILES)
    args = (n_rows, slots, kv_c, k_pe, idx_k, kv_stride, pe_stride, ix_stride)
    if PREFETCH:  # four loop-carried tensors, not one tuple
        slot_n, x_n, xi_n, pe_n = _load_item(item, *args, BLOCK_T)
    while item < n_items:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        # ---- every load of the item first (none waits behind a store to the caches)
        if PREFETCH:
            slot, x, xi, pe = slot_n, x_n, xi_n, pe_n
            slot_n, x_n, xi_n, pe_n = _load_item(item + step, *args, BLOCK_T)
        else:
            slot, x, xi, pe = _load_item(item, *args, BLOCK_T)
        rows = item * BLOCK_T + tl.arange(0, BLOCK_T)
        in_range = rows < n_rows
        # ---- main KV: 4 tiles of 128 values, one scale each
        x3 = tl.reshape(bf16_to_f32(x), (BLOCK_T, _TILES, _TILE))
        amax = tl.max(tl.abs(x3), axis=2)
        if MAIN_POW2:
            s = mla_tile_scale_pow2(amax)  # a power of two: the product is the exact quotient
            q = to_e4m3(x3 * pow2_recip(s)[:, :, None])
        else:
            s = mla_tile_scale(amax)
            q = to_e4m3(tl.math.div_rn(x3, s[:, :, None]))
        codes = tl.reshape(q, (BLOCK_T, _NOPE))
        scale_words = s.to(tl.int32, bitcast=True)  # [rows, 4]: the 4 scales, one 16-byte store
        # ---- indexer K: one scale per token (IDX_SCALE: 0 "ue8m0", 1 "fp32", 2 "mxfp8")
        xf = bf16_to_f32(xi)
        ai = tl.max(tl.abs(xf), axis=1)
        if IDX_SCALE == 1:
            si = indexer_scale_fp32(ai)
            qi = to_e4m3(tl.math.div_rn(xf, si[:, None]))
        else:
            si = indexer_scale(ai)  # a power of two: the product below is the exact quotient
            qi = to_e4m3(xf * pow2_recip(si)[:, None])
        if IDX_SCALE == 2:
            field = e8m0_word(si)
        else:
            field = si.to(tl.int32, bitcast=True)

        # ---- where each row goes in every replica
        live = in_range & (slot >= 0)
        if GATHERED:  # a member's block opens with its header row: nonzero word 0, it refused the write
            header = (kv_c + (rows // per_member) * per_member * kv_stride).to(tl.pointer_type(tl.int64))
            live = live & (tl.load(header, mask=in_range, other=0) == 0)
        slot = tl.where(live, slot, 0)
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        main_row = main_off + block * main_bstride + off * _MAIN_TOKEN
        block_start = idx_off + block * idx_bstride
        idx_val = block_start + off * _IDX
        idx_scale = block_start + BLOCK_SIZE * _IDX + off * _IDX_SCALE
        m_row = live[:, None]
        out = dst + tl.program_id(1) if SPREAD else dst
        for d in tl.static_range(NOUT):
            # Typed base pointers with offsets in elements keep the alignment Triton can prove
            # (every offset here is a multiple of 16 bytes), so the stores vectorize.
            base = tl.load(out + d)
            cache = tl.multiple_of(base.to(tl.pointer_type(tl.uint8)), 16)
            words_at = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
            values_at = tl.multiple_of(base.to(tl.pointer_type(k_pe.dtype.element_ty)), 16)
            tl.store(cache + main_row[:, None] + c_nope[None, :], codes, mask=m_row)
            tl.store(words_at + ((main_row + _MAIN_SCALES) // 4)[:, None] + c4[None, :], scale_words, mask=m_row)
            tl.store(values_at + ((main_row + _ROPE_AT) // 2)[:, None] + c_pe[None, :], pe, mask=m_row)
            tl.store(cache + idx_val[:, None] + c_idx[None, :], qi, mask=m_row)
            tl.store(words_at + idx_scale // 4, field, mask=live)
        item += step

    if FUSED:  # the tail: a whole fence (with HEADER, the write's call header and verdict too)
        if HEADER:
            ssl.fence_call(calls, ptrs, cell, me, timeout_ns, record, 0, layer, n_rows, 0, 0, refused, NDST, TRAP)
        else:
            ssl.grid_fence(ptrs, cell, me, timeout_ns, record, NDST, TRAP)
