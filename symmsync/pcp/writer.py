"""The PCP direct-KV writer: quantize once, write the final cache bytes into every replica.

Two routes, chosen explicitly and agreed by every rank (never a silent mix):

``"direct"``
    Each rank quantizes its own rows and stores the final cache bytes into every
    member of its PCP peer view through the view's pointer table; one fence per
    layer makes them visible. With ``fused=True`` the fence's publish and wait run in
    the writer's tail (:func:`symmsync.language.grid_fence`): no extra launch.
``"allgather"``
    The baseline runtimes ship: all-gather the bf16 inputs over the PCP group
    (torch.distributed), then run the same quantize-and-insert kernel locally on
    the gathered rows. It is the byte oracle of the direct route and the explicit
    fallback where peers cannot be mapped (for example across hosts without NVLink).

Both routes run the same kernel, so their bytes can be compared exactly; the tests
also check every cache format (``CacheLayout(main_scale=..., indexer_scale=...)``,
picked at compile time) against references written in plain torch from the format
rules.

Eager cost: :meth:`DirectKVWriter.prepare` does every check that needs the slot
values; the first :meth:`~DirectKVWriter.write` of a batch packs the kernel launch
(:meth:`symmsync.launch.Launcher.bind`) and later layers only update the input
addresses and the layer's offsets in it (:meth:`symmsync.launch.BoundLaunch.update`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import language as ssl
from ..errors import ClosedError, ConfigError, InputError
from ..fence import Fence
from ..launch import Launcher
from .layout import CacheLayout
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

ROUTES = ("direct", "allgather")


def _power_of_two(v: Any, most: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= most and not v & (v - 1)


def _exchange(group: Any, obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (torch.distributed only: this module uses symmsync's public API)."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


# torch 2.13 renamed all_gather_into_tensor; 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_NOPE, _ROPE, _IDX = 512, 64, 128
_TOKEN = 656
_SCALES, _ROPE_OFF = 512, 528


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
    w32 = tl.arange(0, 32)
    c4 = w32[:, None] * 4 + tl.arange(0, 4)[None, :]  # [32, 4]: byte k of word w is value 4w + k
    c2 = w32[:, None] * 2 + tl.arange(0, 2)[None, :]  # [32, 2]: half k of word w is value 2w + k
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
        tl.store(words + ((main_row + 528) // 4)[:, None] + w32[None, :], pe, mask=m2)


@triton.jit
def _write_main_tile(kv_c, kv_stride, j, rows, live, dst, main_row, NDST: tl.constexpr, MAIN_POW2: tl.constexpr):
    # Main KV tile j: 128 values and their scale.
    w32 = tl.arange(0, 32)
    c4 = w32[:, None] * 4 + tl.arange(0, 4)[None, :]
    m3 = live[:, None, None]
    x = bf16_to_f32(tl.load(kv_c + rows[:, None, None] * kv_stride + j * 128 + c4[None, :, :], mask=m3, other=0))
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
        tl.store(words + ((main_row + j * 128) // 4)[:, None] + w32[None, :], q, mask=live[:, None])
        tl.store(floats + (main_row + 512) // 4 + j, s, mask=live)


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
    cell,
    me,
    timeout_ns,
    record,  # fence arguments (FUSED only)
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
    # one of its five pieces: main-KV tiles 0-3, then indexer K + RoPE) until none are left.
    # With SPREAD an item also names one destination: the programs writing to peers and
    # those writing locally run side by side (each quantizes its rows itself).
    PIECES: tl.constexpr = 5 if SPLIT else 1
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
        main_row = main_off + slot * 656  # byte offset of each row's 656 bytes in every replica
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        idx_val = idx_off + block * (BLOCK_SIZE * 132) + off * 128
        idx_scale = idx_off + block * (BLOCK_SIZE * 132) + BLOCK_SIZE * 128 + off * 4
        if SPLIT:
            piece = work % PIECES
            if piece < 4:
                _write_main_tile(kv_c, kv_stride, piece, rows, live, out, main_row, NOUT, MAIN_POW2)
            else:
                _write_indexer_and_rope(
                    idx_k, k_pe, ix_stride, pe_stride, rows, live, out, main_row, idx_val, idx_scale, NOUT, IDX_SCALE
                )
        else:
            _write_indexer_and_rope(
                idx_k, k_pe, ix_stride, pe_stride, rows, live, out, main_row, idx_val, idx_scale, NOUT, IDX_SCALE
            )
            for j in tl.static_range(4):
                _write_main_tile(kv_c, kv_stride, j, rows, live, out, main_row, NOUT, MAIN_POW2)
        item += step

    if FUSED:
        ssl.grid_fence(dst, cell, me, timeout_ns, record, NDST, TRAP)


@dataclass
class Batch:
    """One prefill batch as agreed by every rank: the local slot mapping, validated once.

    A runtime computes its slot mapping once per batch and reuses it for every layer,
    so the checks that need the values (range, duplicates) and the rank consensus
    happen here, not per layer. :meth:`DirectKVWriter.write` takes only a batch that the
    same writer's :meth:`~DirectKVWriter.prepare` returned, and trusts its slots: do not
    modify them in place.
    """

    slots: torch.Tensor  #: int64 [rows] local slot mapping (-1: padding)
    rows: int
    gathered_slots: torch.Tensor | None = None  #: allgather route: every rank's slots, rank-major
    writer: Any = field(default=None, repr=False, compare=False)  #: the writer whose prepare() made it
    # Made once per batch and reused by every layer's write(): the packed launch, and the
    # all-gather route's staging tensors.
    _bound: Any = field(default=None, repr=False, compare=False)
    _grid: tuple = field(default=(1, 1, 1), repr=False, compare=False)
    _packed: Any = field(default=None, repr=False, compare=False)
    _gathered: Any = field(default=None, repr=False, compare=False)


class DirectKVWriter:
    """Writes a PCP group's KV-cache bytes into every replica, one layer at a time.

    Args:
        view: this rank's PCP peer view (``symmsync.pcp_view(buffer, tp)``).
        layout: where every layer's caches live in the view's buffer.
        route: ``"direct"`` or ``"allgather"``; every rank must pass the same.
        fused: direct route only: publish and wait in the writer's tail (no fence launch).
        group: the torch.distributed group of the view's ranks; needed by the allgather
            route when the view is not the whole world.
        channel: the fence channel of the view the writer uses.
        timeout_s: fence wait budget (default: the backend's).
        debug: also check, at :meth:`prepare`, that no slot is claimed twice across the
            PCP group (one more exchange per batch).
        block_rows: rows per work item of the kernel (a power of two).
        num_warps: warps per program.
        split: give each of a row block's five pieces (four main-KV tiles; indexer K
            with RoPE) its own work item.
        spread: give each destination replica its own work items (each quantizes its
            rows itself), so that programs storing to peers and programs storing locally
            run side by side instead of one after the other in every program.
        programs_per_sm: size of the persistent grid on GPUs, per multiprocessor.

    The defaults (16 rows, 4 warps, no split, no spread) are as fast as any
    configuration of the sweep in benchmarks/pcp_kv.py on 2x H200: at 32k tokens per
    rank all took 115-126 µs per layer, bound by the stores to the peer.

    Construction is collective over the buffer's group: every rank agrees on the route,
    and the members of a PCP group on the layout (formats included) and the channel.
    The writer's :attr:`fence` is a :class:`~symmsync.Fence` on both routes.
    """

    def __init__(
        self,
        view: Any,
        layout: CacheLayout,
        *,
        route: str = "direct",
        fused: bool = False,
        group: Any = None,
        channel: int = 0,
        timeout_s: float | None = None,
        debug: bool = False,
        block_rows: int = 16,
        num_warps: int = 4,
        split: bool = False,
        programs_per_sm: int = 4,
        spread: bool = False,
    ):
        buf = view.buffer
        self.view, self.layout, self.route, self.fused, self.debug = view, layout, route, bool(fused), debug
        self.buffer = buf
        problem = None
        if not isinstance(layout, CacheLayout):
            problem = f"layout must be a symmsync.pcp.CacheLayout, got {type(layout).__name__}"
        elif not isinstance(route, str) or route not in ROUTES:
            problem = f"route must be one of {ROUTES}, got {route!r}"
        elif fused and route != "direct":
            problem = "fused=True needs route='direct' (the all-gather route has no fence to fuse)"
        elif layout.end > buf.nbytes:
            problem = f"the cache layout needs {layout.end} bytes but the buffer holds {buf.nbytes}"
        elif route == "allgather" and group is None and view.size != buf.world_size:
            problem = "the allgather route needs group=, the torch.distributed group of the view's ranks"
        elif not _power_of_two(block_rows, 1024):
            problem = f"block_rows must be a power of two up to 1024, got {block_rows!r}"
        elif not _power_of_two(num_warps, 32):
            problem = f"num_warps must be a power of two up to 32, got {num_warps!r}"
        elif not isinstance(programs_per_sm, int) or isinstance(programs_per_sm, bool) or programs_per_sm <= 0:
            problem = f"programs_per_sm must be a positive int, got {programs_per_sm!r}"
        fence = None
        if problem is None:
            try:  # a bad channel or timeout is agreed like the rest, so that every rank raises
                fence = Fence(view, channel, timeout_s=timeout_s)
            except ConfigError as e:
                problem = str(e)
        mine = (route, bool(fused), layout, channel) if problem is None else ("?", False, None, None)
        agreed = _exchange(buf.group, (*mine, problem), buf.world_size)
        bad = [(r, a[-1]) for r, a in enumerate(agreed) if a[-1]]
        if bad:
            raise ConfigError(f"DirectKVWriter: rank {bad[0][0]}: {bad[0][1]}")
        if len({(r, f) for r, f, *_ in agreed}) > 1:
            per = ", ".join(f"rank {i}: {r}{' fused' if f else ''}" for i, (r, f, *_) in enumerate(agreed))
            raise ConfigError(f"DirectKVWriter: every rank must take the same route ({per})")
        for i, what in ((2, "layout"), (3, "channel")):
            if len({agreed[r][i] for r in view.ranks}) > 1:
                per = ", ".join(f"rank {r}: {agreed[r][i]!r}" for r in view.ranks)
                raise ConfigError(
                    f"DirectKVWriter: the members of the PCP group {list(view.ranks)} passed different "
                    f"{what}s ({per}); every member must pass the same"
                )
        self.group = group
        self.block_rows = block_rows
        #: The fence of the writer's channel on its view. The direct route fences with it
        #: after every layer; the all-gather route does not need it (NCCL orders the
        #: gather) but it is there on both routes, to order other peer traffic.
        self.fence = fence
        if route == "direct":
            dst = view.ptrs
        else:
            dst = buf.ptrs[buf.rank : buf.rank + 1].contiguous()
        self._dst = dst
        self._trap = buf.backend == "cuda"
        self._pieces = (5 if split else 1) * (dst.numel() if spread else 1)
        if buf.backend == "cuda":
            sms = torch.cuda.get_device_properties(buf.device).multi_processor_count
            self._max_programs = max(1, sms * programs_per_sm)
        else:
            self._max_programs = 4  # the interpreter runs programs one after another
        self._launcher = Launcher(
            _quantize_write_kernel,
            (1,),
            num_warps=num_warps,
            NDST=dst.numel(),
            BLOCK_T=block_rows,
            BLOCK_SIZE=layout.block_size,
            SPLIT=bool(split),
            FUSED=self.fused,
            TRAP=self._trap,
            MAIN_POW2=layout.main_scale == "pow2",
            IDX_SCALE=("ue8m0", "fp32", "mxfp8").index(layout.indexer_scale),
            SPREAD=bool(spread),
        )
        self._host = buf.backend == "host"
        self._device_index = buf.device.index if buf.backend == "cuda" else -1
        # Per-layer region offsets, computed once.
        self._offsets = [(layout.main_offset(i), layout.indexer_offset(i)) for i in range(layout.num_layers)]

    # ------------------------------------------------------------------ per batch
    def prepare(self, slot_mapping: torch.Tensor) -> Batch:
        """Validate this rank's slot mapping (collective over the buffer's group).

        Raises:
            InputError: on every rank, when any rank's mapping has the wrong dtype,
                device or shape, a slot outside ``[-1, num_slots)``, a different number
                of rows than the others, or (``debug``) a slot claimed twice.
        """
        buf = self.buffer
        problem = None
        slots = None
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            problem = "slot_mapping must be a 1-D tensor"
        elif slot_mapping.dtype not in (torch.int32, torch.int64):
            problem = f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}"
        elif slot_mapping.device != buf.device:
            problem = f"slot_mapping is on {slot_mapping.device}, the buffer on {buf.device}"
        else:
            slots = slot_mapping.to(torch.int64).contiguous()
            if slots.numel():
                lo, hi = int(slots.min()), int(slots.max())
                n = self.layout.num_slots
                if lo < -1 or hi >= n:
                    bad = lo if lo < -1 else hi
                    problem = f"slot {bad} is outside [-1, {n}) (the cache has {self.layout.num_blocks} blocks)"
        rows = slots.numel() if slots is not None else -1
        payload = (rows, problem, slots.cpu() if (self.debug and slots is not None) else None)
        every = _exchange(buf.group, payload, buf.world_size)
        bad = [(r, p) for r, (_, p, _) in enumerate(every) if p]
        if bad:
            raise InputError(f"DirectKVWriter.prepare: rank {bad[0][0]}: {bad[0][1]}")
        members = [every[r] for r in self.view.ranks]
        if len({m[0] for m in members}) > 1:
            per = ", ".join(f"rank {r}: {m[0]}" for r, m in zip(self.view.ranks, members))
            raise InputError(
                f"DirectKVWriter.prepare: ranks of a PCP group must have equal row counts ({per}); "
                "pad with slot -1 (symmsync.pcp.pcp_split does)"
            )
        if self.debug:
            self._check_duplicates(every)
        batch = Batch(slots=slots, rows=rows, writer=self)  # write() takes only batches this writer validated
        launched_rows = rows
        if self.route == "allgather":
            batch.gathered_slots = self._all_gather(slots)
            launched_rows = rows * self.view.size
            width = _NOPE + _ROPE + _IDX
            packed = torch.empty((rows, width), dtype=torch.int16, device=buf.device)
            gathered = torch.empty((launched_rows, width), dtype=torch.int16, device=buf.device)
            fields = (slice(0, _NOPE), slice(_NOPE, _NOPE + _ROPE), slice(_NOPE + _ROPE, width))
            batch._packed = (packed, *[packed[:, f] for f in fields])
            batch._gathered = (gathered, *[gathered[:, f] for f in fields])
        batch._grid = self._grid_for(launched_rows)
        return batch

    def _grid_for(self, rows: int) -> tuple[int, int, int]:
        """The persistent grid for ``rows`` rows: one program at least (the fused tail must run)."""
        items = triton.cdiv(rows, self.block_rows) * self._pieces
        return (max(1, min(items, self._max_programs)), 1, 1)

    def _check_duplicates(self, every: list) -> None:
        # Every rank checks its own PCP group from the mappings all ranks sent.
        seen: dict[int, int] = {}
        for r in self.view.ranks:
            for s in every[r][2].tolist():
                if s < 0:
                    continue
                if s in seen:
                    raise InputError(
                        f"DirectKVWriter.prepare (debug): slot {s} is written by rank {seen[s]} and "
                        f"rank {r} of the PCP group {list(self.view.ranks)}; each token needs one owner"
                    )
                seen[s] = r

    # ------------------------------------------------------------------ per layer
    def write(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, indexer_k: torch.Tensor, batch: Batch) -> None:
        """Quantize this rank's rows of ``layer`` and make them visible in every replica.

        Direct route: one writer launch into every member's replica plus one fence (or
        the fused tail); on return (in stream order), every replica of the PCP group
        holds the layer's bytes of every member's rows. Allgather route: an all-gather
        of the inputs, then an insert into this rank's replica; on return this rank's
        replica holds every member's rows (each member fills its own replica: read a
        peer's replica only after a fence, e.g. ``writer.fence.fence()``).

        The launch is packed once per batch (at the batch's first write); each layer
        only changes the input addresses and the layer's offsets in it.

        Raises:
            InputError: wrong layer, dtype, shape, device, or non-contiguous input;
                raised before any byte is written, after aborting the writer's view
                (:meth:`symmsync.Fence.abort`): the other members raise
                :class:`~symmsync.PeerAborted` naming this rank at once, and this
                writer's fences fail from then on. (On the all-gather route the
                others wait in torch.distributed's all-gather, which an abort does
                not reach: torch.distributed's failure handling applies there.)
        """
        rows = batch.rows if type(batch) is Batch else -1
        if not (
            rows >= 0
            and type(layer) is int
            and 0 <= layer < self.layout.num_layers
            and batch.writer is self
            and self._input_ok(kv_c, rows, _NOPE)
            and self._input_ok(k_pe, rows, _ROPE)
            and self._input_ok(indexer_k, rows, _IDX)
        ):
            try:
                self._check_inputs(layer, kv_c, k_pe, indexer_k, batch)  # raises, naming the problem
            except InputError as e:
                # The members may already wait in this layer's fence: tell them at once
                # (they raise PeerAborted naming this rank and the reason) instead of
                # letting them wait out their budget. Nothing was written.
                self.fence.abort(f"DirectKVWriter.write: {e}")
                raise
        if self.route == "allgather":
            self._insert_gathered(layer, kv_c, k_pe, indexer_k, batch)
            return
        if self.fused:  # the tail fences inside the kernel: refuse here what Fence.fence() would
            self.fence.check_usable()
        if self._host:  # the interpreter reads bf16 rows as int16 bits
            kv_c, k_pe, indexer_k = kv_c.view(torch.int16), k_pe.view(torch.int16), indexer_k.view(torch.int16)
        self._launch(layer, kv_c, k_pe, indexer_k, _NOPE, _ROPE, _IDX, batch.slots, rows, batch)
        if self.fused:
            if self._host:
                self.fence.check()
        else:
            self.fence.fence()

    def _input_ok(self, t: Any, rows: int, width: int) -> bool:
        return (
            type(t) is torch.Tensor
            and t.dtype is torch.bfloat16
            and t.shape == (rows, width)
            and t.get_device() == self._device_index  # -1 for CPU, and for meta tensors too:
            and (t.is_cuda or t.is_cpu)  # so a tensor without memory never reaches a launch
            and t.is_contiguous()
        )

    def _check_inputs(self, layer, kv_c, k_pe, indexer_k, batch) -> None:
        rank = self.buffer.rank
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.layout.num_layers:
            raise InputError(
                f"rank {rank}: layer {layer!r} is out of range for a cache of {self.layout.num_layers} layers"
            )
        if not isinstance(batch, Batch) or batch.writer is not self:
            raise InputError(
                f"rank {rank}: pass the Batch returned by this writer's prepare() (its slots were checked "
                "against this writer's layout)"
            )
        for name, t, width in (("kv_c", kv_c, _NOPE), ("k_pe", k_pe, _ROPE), ("indexer_k", indexer_k, _IDX)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"rank {rank}: {name} must be a tensor")
            if t.dtype != torch.bfloat16:
                raise InputError(f"rank {rank}: {name} must be bfloat16, got {t.dtype}")
            if t.shape != (batch.rows, width):
                raise InputError(
                    f"rank {rank}: {name} must have shape ({batch.rows}, {width}) to match the batch's "
                    f"slot mapping, got {tuple(t.shape)}"
                )
            if t.device != self.buffer.device:
                raise InputError(f"rank {rank}: {name} is on {t.device}, the cache on {self.buffer.device}")
            if not t.is_contiguous():
                raise InputError(f"rank {rank}: {name} must be contiguous (call .contiguous())")
        raise InputError(f"rank {rank}: write() was given an input it cannot take")  # pragma: no cover

    # Positions of the arguments that change from layer to layer in the kernel's list.
    _PER_LAYER = (0, 1, 2, 9, 10)

    def _launch(self, layer, kv_c, k_pe, idx_k, kv_stride, pe_stride, ix_stride, slots, rows, batch) -> None:
        if self.buffer.closed:
            raise ClosedError(f"rank {self.buffer.rank}: DirectKVWriter.write used after its buffer was closed")
        main_off, idx_off = self._offsets[layer]
        bound = batch._bound
        if bound is None:
            f = self.fence
            cell, me, timeout_ns, record = (f.cell, self.view.local_index, f.timeout_ns, f.record)
            bound = batch._bound = self._launcher.bind(
                kv_c,
                k_pe,
                idx_k,
                kv_stride,
                pe_stride,
                ix_stride,
                slots,
                rows,
                self._dst,
                main_off,
                idx_off,
                cell,
                me,
                timeout_ns,
                record,
                grid=batch._grid,
            )
        else:
            bound.update(self._PER_LAYER, (kv_c, k_pe, idx_k, main_off, idx_off))
        bound()

    # ------------------------------------------------------------------ baseline
    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self.view.size * t.shape[0],) + tuple(t.shape[1:]))
        _all_gather_single(out, t.contiguous(), group=self.group)
        return out

    def _insert_gathered(self, layer, kv_c, k_pe, indexer_k, batch) -> None:
        packed, p_kv, p_pe, p_ix = batch._packed
        gathered, g_kv, g_pe, g_ix = batch._gathered
        p_kv.copy_(kv_c.view(torch.int16))
        p_pe.copy_(k_pe.view(torch.int16))
        p_ix.copy_(indexer_k.view(torch.int16))
        # Bytes travel on every backend (gloo has no int16 all-gather).
        _all_gather_single(gathered.view(torch.uint8), packed.view(torch.uint8), group=self.group)
        width = _NOPE + _ROPE + _IDX
        self._launch(layer, g_kv, g_pe, g_ix, width, width, width, batch.gathered_slots, gathered.shape[0], batch)

    def bytes_per_layer(self, rows: int) -> dict[str, int]:
        """What one layer moves per rank: cache bytes written, and bytes sent to peers."""
        token = _TOKEN + 132
        peers = self.view.size - 1
        if self.route == "direct":
            return {"cache_bytes_written": rows * token * self.view.size, "sent_to_peers": rows * token * peers}
        inputs = rows * (_NOPE + _ROPE + _IDX) * 2
        return {"cache_bytes_written": rows * token * self.view.size, "sent_to_peers": inputs * peers}
