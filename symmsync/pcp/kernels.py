"""The writer's kernel and the byte geometry it writes.

:func:`_quantize_write_kernel` quantizes rows of bf16 inputs (``kv_c``, ``k_pe``,
``indexer_k``) and stores the final cache bytes of every row into each destination of a
table of base addresses: a token's 656 main-KV bytes at ``main_off + block *
main_bstride + offset * 656`` and its indexer-K values and scale field in its block of
the indexer region (:mod:`symmsync.pcp.layout` gives the format). With ``FUSED`` its
tail is a whole fence (:func:`symmsync.language.grid_fence`).

:class:`~symmsync.pcp.DirectKVWriter` launches it; nothing here checks its arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import language as ssl
from .layout import IndexerKLayout, MainKVLayout
from .quant import (
    bf16_to_f32,
    e8m0_word,
    indexer_scale,
    indexer_scale_fp32,
    mla_tile_scale,
    mla_tile_scale_pow2,
    pow2_recip,
    to_e4m3,
)

#: Widths of a row of the inputs: kv_c, k_pe, indexer_k (bf16 values).
NOPE, ROPE, IDX = MainKVLayout.NOPE_DIM, MainKVLayout.ROPE_DIM, IndexerKLayout.DIM
#: Cache bytes of one token: main KV and indexer K.
TOKEN_BYTES = MainKVLayout.TOKEN_BYTES + IndexerKLayout.TOKEN_BYTES

# The byte geometry the kernel writes, from the layout module. Triton reads a module
# global inside a kernel only when it is a ``tl.constexpr``.
_MAIN_TOKEN = tl.constexpr(MainKVLayout.TOKEN_BYTES)  # a token's main-KV bytes
_MAIN_SCALES = tl.constexpr(MainKVLayout.SCALES_OFFSET)  # its fp32 tile scales
_MAIN_ROPE = tl.constexpr(MainKVLayout.ROPE_OFFSET)  # its bf16 RoPE values
_TILE = tl.constexpr(MainKVLayout.TILE)  # values per main-KV tile (one scale each)
_TILES = tl.constexpr(MainKVLayout.NUM_TILES)
_IDX_TOKEN = tl.constexpr(IndexerKLayout.TOKEN_BYTES)  # a token's indexer-K bytes, values and scale
_IDX_VALUES = tl.constexpr(IndexerKLayout.DIM)  # a token's indexer-K value bytes
_IDX_SCALE = tl.constexpr(IndexerKLayout.SCALE_BYTES)  # a token's scale field
# int32 words per row piece: a main-KV tile's or the indexer's fp8 codes (4 per word), and
# the RoPE values (2 bf16 per word) fill the same number of words.
_WORDS = tl.constexpr(MainKVLayout.TILE // 4)
assert MainKVLayout.TILE == IndexerKLayout.DIM == 2 * MainKVLayout.ROPE_DIM, "the kernel's word packing"


@triton.jit
def _pack(codes, SHIFT: tl.constexpr):
    """Pack the last axis (4 bytes or 2 halves) of ``codes`` into int32 words, low first.

    Stores of whole words (16 bytes per thread once Triton vectorizes them) reach
    peers over NVLink far faster than byte stores."""
    n: tl.constexpr = 32 // SHIFT
    k = tl.arange(0, n)[None, None, :] * SHIFT
    # The fields do not overlap, so their sum is their bitwise or (and wraps like it).
    return tl.sum((codes.to(tl.int32) & ((1 << SHIFT) - 1)) << k, axis=2)


@triton.jit
def _write_indexer_and_rope(
    idx_k,
    k_pe,
    ix_stride,
    pe_stride,
    rows,
    live,
    dst,
    main_row,
    idx_val,
    idx_scale,
    NDST: tl.constexpr,
    IDX_SCALE: tl.constexpr,
):
    w32 = tl.arange(0, _WORDS)
    c4 = w32[:, None] * 4 + tl.arange(0, 4)[None, :]  # [words, 4]: byte k of word w is value 4w + k
    c2 = w32[:, None] * 2 + tl.arange(0, 2)[None, :]  # [words, 2]: half k of word w is value 2w + k
    m3 = live[:, None, None]
    m2 = live[:, None]
    # Indexer K: one scale per token (IDX_SCALE: 0 "ue8m0", 1 "fp32", 2 "mxfp8").
    xi = bf16_to_f32(tl.load(idx_k + rows[:, None, None] * ix_stride + c4[None, :, :], mask=m3, other=0))
    ai = tl.max(tl.max(tl.abs(xi), axis=2), axis=1)
    if IDX_SCALE == 1:
        si = indexer_scale_fp32(ai)
        qi = _pack(to_e4m3(tl.math.div_rn(xi, si[:, None, None])), 8)
    else:
        si = indexer_scale(ai)  # a power of two: the product below is the exact quotient
        qi = _pack(to_e4m3(xi * pow2_recip(si)[:, None, None]), 8)
    # RoPE values are copied as bits: bitcast, never a value conversion (the rows may be bf16).
    pe_bits = tl.load(k_pe + rows[:, None, None] * pe_stride + c2[None, :, :], mask=m3, other=0)
    pe = _pack(pe_bits.to(tl.int16, bitcast=True), 16)
    for d in tl.static_range(NDST):
        # Typed base pointers with offsets in elements keep the alignment Triton can prove
        # (every offset here is a multiple of 16 bytes), so the word stores vectorize.
        words = tl.multiple_of(tl.load(dst + d).to(tl.pointer_type(tl.int32)), 16)
        floats = tl.multiple_of(tl.load(dst + d).to(tl.pointer_type(tl.float32)), 16)
        tl.store(words + (idx_val // 4)[:, None] + w32[None, :], qi, mask=m2)
        if IDX_SCALE == 2:
            tl.store(words + idx_scale // 4, e8m0_word(si), mask=live)
        else:
            tl.store(floats + idx_scale // 4, si, mask=live)
        tl.store(words + ((main_row + _MAIN_ROPE) // 4)[:, None] + w32[None, :], pe, mask=m2)


@triton.jit
def _write_main_tile(kv_c, kv_stride, j, rows, live, dst, main_row, NDST: tl.constexpr, MAIN_POW2: tl.constexpr):
    # Main KV tile j: its values and their scale.
    w32 = tl.arange(0, _WORDS)
    c4 = w32[:, None] * 4 + tl.arange(0, 4)[None, :]
    m3 = live[:, None, None]
    x = bf16_to_f32(tl.load(kv_c + rows[:, None, None] * kv_stride + j * _TILE + c4[None, :, :], mask=m3, other=0))
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    if MAIN_POW2:
        s = mla_tile_scale_pow2(amax)  # a power of two: the product is the exact quotient
        q = _pack(to_e4m3(x * pow2_recip(s)[:, None, None]), 8)
    else:
        s = mla_tile_scale(amax)
        q = _pack(to_e4m3(tl.math.div_rn(x, s[:, None, None])), 8)
    for d in tl.static_range(NDST):
        words = tl.multiple_of(tl.load(dst + d).to(tl.pointer_type(tl.int32)), 16)
        floats = tl.multiple_of(tl.load(dst + d).to(tl.pointer_type(tl.float32)), 16)
        tl.store(words + ((main_row + j * _TILE) // 4)[:, None] + w32[None, :], q, mask=live[:, None])
        tl.store(floats + (main_row + _MAIN_SCALES) // 4 + j, s, mask=live)


@triton.jit
def _quantize_write_kernel(
    kv_c,
    k_pe,
    idx_k,
    kv_stride,
    pe_stride,
    ix_stride,  # bf16 rows, read as int16 bits
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
    NDST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED: tl.constexpr,
    TRAP: tl.constexpr,
    MAIN_POW2: tl.constexpr,
    IDX_SCALE: tl.constexpr,
    SPREAD: tl.constexpr,
):
    # A persistent grid: each program takes work items (a block of rows, and with SPLIT
    # one of its pieces: each main-KV tile, then indexer K + RoPE) until none are left.
    # With SPREAD an item also names one destination: the programs writing to peers and
    # those writing locally run side by side (each quantizes its rows itself).
    PIECES: tl.constexpr = _TILES + 1 if SPLIT else 1
    NWAYS: tl.constexpr = NDST if SPREAD else 1
    NOUT: tl.constexpr = 1 if SPREAD else NDST  # destinations each item stores to
    n_items = tl.cdiv(n_rows, BLOCK_T) * PIECES * NWAYS
    item = tl.program_id(0)
    step = tl.num_programs(0)
    while item < n_items:  # a while loop: the interpreter of triton 3.6 cannot range() over tensors
        if SPREAD:
            out = dst + item % NWAYS
            work = item // NWAYS
        else:
            out = dst
            work = item
        rows = (work // PIECES) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_range = rows < n_rows
        slot = tl.load(slots + rows, mask=in_range, other=-1)
        live = in_range & (slot >= 0)
        slot = tl.where(live, slot, 0)
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        main_row = main_off + block * main_bstride + off * _MAIN_TOKEN  # each row's main KV in every replica
        block_start = idx_off + block * idx_bstride
        idx_val = block_start + off * _IDX_VALUES
        idx_scale = block_start + BLOCK_SIZE * _IDX_VALUES + off * _IDX_SCALE
        if SPLIT:
            piece = work % PIECES
            if piece < _TILES:
                _write_main_tile(kv_c, kv_stride, piece, rows, live, out, main_row, NOUT, MAIN_POW2)
            else:
                _write_indexer_and_rope(
                    idx_k, k_pe, ix_stride, pe_stride, rows, live, out, main_row, idx_val, idx_scale, NOUT, IDX_SCALE
                )
        else:
            _write_indexer_and_rope(
                idx_k, k_pe, ix_stride, pe_stride, rows, live, out, main_row, idx_val, idx_scale, NOUT, IDX_SCALE
            )
            for j in tl.static_range(_TILES):
                _write_main_tile(kv_c, kv_stride, j, rows, live, out, main_row, NOUT, MAIN_POW2)
        item += step

    if FUSED:
        ssl.grid_fence(ptrs, cell, me, timeout_ns, record, NDST, TRAP)
