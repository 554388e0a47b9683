"""Byte layouts of the DeepSeek-V3.2 sparse-MLA caches on a packed symmetric backing.

The one statement of the writer's bytes: docs/pcp.md shows the two blocks below as written
here; :mod:`symmsync.pcp.quant` computes them, :mod:`symmsync.pcp.kernels` stores them, and
:class:`MainKVLayout` and :class:`IndexerKLayout` hold their numbers as constants.

Where a token's bytes go::

    --8<-- [start:bytes]
    slots      slot = block * block_size + offset (block size 64 by default);
               slot -1 is padding and is never written
    main KV    "fp8_ds_mla", 656 bytes per token, at slot * 656 in the layer's main region:
               [0, 512)     512 kv_c values, float8_e4m3fn, in 4 tiles of 128
               [512, 528)   4 fp32 tile scales (little endian), one per tile
               [528, 656)   64 k_pe values, bf16, copied bit for bit
    indexer K  132 bytes per token, laid out per block in the layer's indexer region:
               block * (block_size * 132) + offset * 128                    128 fp8 values
               block * (block_size * 132) + block_size * 128 + offset * 4   its 4-byte scale field
    backing    one layer's main region, then its indexer region, each padded to 128 bytes;
               layers follow each other from base in the symmetric buffer
    --8<-- [end:bytes]

The scale rules (``CacheLayout(main_scale=..., indexer_scale=...)``; the defaults first)::

    --8<-- [start:scales]
    amax              the largest |x| of a main-KV tile (128 values) or of an indexer-K
                      token (128 values), in fp32 (a bf16 input widens exactly)
    arithmetic        IEEE fp32 division, round to nearest; 448 and FLT_MIN = 2**-126 are
                      exact, 1e-4 is the fp32 value nearest to it (bits 0x38D1B717)
    codes             e4m3fn(x / s), rounded to nearest even, saturating at +-448
    main "pow2"       s = the smallest power of two >= max(amax / 448, 1e-4) (the floor
                      applies to the quotient); stored as fp32
    main "fp32"       s = max(amax / 448, FLT_MIN); stored as fp32
    indexer "ue8m0"   s = the smallest power of two >= m, m = max(amax, 1e-4) / 448 (the
                      floor applies to amax; s = m when m is one already); stored as fp32
    indexer "fp32"    s = max(amax, 1e-4) / 448; stored as fp32
    indexer "mxfp8"   s as for "ue8m0"; the 4-byte field holds its biased exponent byte
                      (E8M0, log2(s) + 127) four times
    --8<-- [end:scales]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..checks import index_problem, int_problem, is_int, positive_int_problem
from ..errors import BoundsError, ConfigError
from ..ops.fence_op import user_views
from .quant import INDEXER_DIM, INDEXER_SCALES, MAIN_SCALES, MLA_NOPE_DIM, MLA_ROPE_DIM, MLA_TILE, MLA_TOKEN_BYTES

if TYPE_CHECKING:
    from ..core.buffer import SymmetricBuffer

_ALIGN = 128


def _up(x: int, m: int = _ALIGN) -> int:
    return (x + m - 1) // m * m


def _formats_problem(main_scale: object, indexer_scale: object) -> str | None:
    """What is wrong with a pair of scale formats, or ``None`` (the one check of them)."""
    if main_scale not in MAIN_SCALES:
        return f"main_scale must be one of {MAIN_SCALES}, got {main_scale!r}"
    if indexer_scale not in INDEXER_SCALES:
        return f"indexer_scale must be one of {INDEXER_SCALES}, got {indexer_scale!r}"
    return None


class _Layers:
    """The layer check shared by :class:`CacheLayout` and :class:`CacheTensors`."""

    num_layers: int

    def layer_problem(self, layer: int) -> tuple[type[ConfigError], str] | None:
        """What is wrong with ``layer`` as one of this cache's layers, and the error it
        raises, or ``None``. The one check of a layer: :meth:`check_layer` and
        ``DirectKVWriter.write`` raise what it finds.
        """
        problem = index_problem("layer", layer, self.num_layers, "the cache")
        if problem is None:
            return None
        return (BoundsError if is_int(layer) else ConfigError), problem

    def check_layer(self, layer: int) -> None:
        """Raise unless ``layer`` is one of this cache's layers.

        Raises:
            BoundsError: ``layer`` is an int outside ``[0, num_layers)``.
            ConfigError: ``layer`` is not an int (a bool is not).
        """
        bad = self.layer_problem(layer)
        if bad is not None:
            error, problem = bad
            raise error(f"{type(self).__name__}: {problem}")


@dataclass(frozen=True)
class MainKVLayout:
    """fp8_ds_mla: the byte offsets of every field of a token's 656 bytes."""

    TOKEN_BYTES = MLA_TOKEN_BYTES  #: 656
    NOPE_OFFSET = 0  #: 512 fp8 values
    NOPE_DIM = MLA_NOPE_DIM
    TILE = MLA_TILE  #: values per scale
    SCALES_OFFSET = MLA_NOPE_DIM  #: 512: 4 fp32 scales
    NUM_TILES = MLA_NOPE_DIM // MLA_TILE
    ROPE_OFFSET = MLA_NOPE_DIM + 4 * (MLA_NOPE_DIM // MLA_TILE)  #: 528: 64 bf16 values
    ROPE_DIM = MLA_ROPE_DIM

    def token_offset(self, slot: int) -> int:
        """Byte offset of a slot's 656 bytes from the start of the main region."""
        return slot * self.TOKEN_BYTES


@dataclass(frozen=True)
class IndexerKLayout:
    """Indexer K: 128 fp8 values and one 4-byte scale field per token, grouped per block.

    The field holds an fp32 scale, or for ``indexer_scale="mxfp8"`` the scale's E8M0
    byte four times.
    """

    block_size: int = 64
    DIM = INDEXER_DIM  #: 128 fp8 values per token
    SCALE_BYTES = 4  #: the scale field: one fp32, or four E8M0 bytes
    TOKEN_BYTES = INDEXER_DIM + SCALE_BYTES  #: 132

    def __post_init__(self) -> None:
        problem = positive_int_problem("block_size", self.block_size)
        if problem is not None:
            raise ConfigError(f"IndexerKLayout: {problem}")

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.TOKEN_BYTES

    def value_offset(self, slot: int) -> int:
        """Byte offset of a slot's 128 fp8 values from the start of the indexer region."""
        block, off = divmod(slot, self.block_size)
        return block * self.block_bytes + off * self.DIM

    def scale_offset(self, slot: int) -> int:
        """Byte offset of a slot's 4-byte scale field from the start of the indexer region."""
        block, off = divmod(slot, self.block_size)
        return block * self.block_bytes + self.block_size * self.DIM + off * self.SCALE_BYTES


@dataclass(frozen=True)
class CacheLayout(_Layers):
    """Every layer's main-KV and indexer-K cache on one symmetric buffer.

    Args:
        num_blocks: cache blocks per layer.
        num_layers: layers packed one after another.
        block_size: tokens per block (64 for DeepSeek-V3.2).
        base: byte offset of layer 0 in the buffer's user region (a multiple of 128).
        main_scale: main-KV tile-scale format, ``"pow2"`` (vLLM >= 0.33, FlashMLA) or
            ``"fp32"`` (vLLM <= 0.11); see the module docstring for the rules.
        indexer_scale: indexer-K scale format, ``"ue8m0"`` (DeepSeek-V3.2),
            ``"fp32"`` or ``"mxfp8"`` (vLLM 0.33).

    Raises:
        ConfigError: a size is not a positive int, ``base`` is negative or not a
            multiple of 128, or a format is not one of :data:`MAIN_SCALES` /
            :data:`INDEXER_SCALES`.
    """

    num_blocks: int
    num_layers: int = 1
    block_size: int = 64
    base: int = 0
    main_scale: str = "pow2"
    indexer_scale: str = "ue8m0"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size"):
            problem = positive_int_problem(name, getattr(self, name))
            if problem is not None:
                raise ConfigError(f"CacheLayout: {problem}")
        problem = int_problem("base", self.base, minimum=0, multiple_of=_ALIGN)
        if problem is not None:
            raise ConfigError(f"CacheLayout: {problem}")
        problem = _formats_problem(self.main_scale, self.indexer_scale)
        if problem is not None:
            raise ConfigError(f"CacheLayout: {problem}")

    main = MainKVLayout()

    @property
    def indexer(self) -> IndexerKLayout:
        return IndexerKLayout(self.block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def main_bytes(self) -> int:
        """Bytes of one layer's main-KV region, padded to 128."""
        return _up(self.num_slots * MainKVLayout.TOKEN_BYTES)

    @property
    def indexer_bytes(self) -> int:
        """Bytes of one layer's indexer-K region, padded to 128."""
        return _up(self.num_blocks * self.indexer.block_bytes)

    @property
    def layer_bytes(self) -> int:
        return self.main_bytes + self.indexer_bytes

    @property
    def nbytes(self) -> int:
        """Bytes from ``base`` to the end of the last layer."""
        return self.num_layers * self.layer_bytes

    @property
    def end(self) -> int:
        """Byte offset just past the last layer: the buffer needs at least this many bytes."""
        return self.base + self.nbytes

    def main_offset(self, layer: int) -> int:
        """Byte offset of a layer's main-KV region in the buffer (:meth:`check_layer`
        says what a bad ``layer`` raises)."""
        self.check_layer(layer)
        return self.base + layer * self.layer_bytes

    def indexer_offset(self, layer: int) -> int:
        """Byte offset of a layer's indexer-K region in the buffer."""
        return self.main_offset(layer) + self.main_bytes

    # ------------------------------------------------------------------ placement
    def placement(self, buffer: SymmetricBuffer) -> Placement:
        """Where the writer finds every layer in ``buffer`` (the same on every member).

        Raises:
            BoundsError: the layout needs more bytes than the buffer holds.
        """
        if self.end > buffer.nbytes:
            raise BoundsError(f"the cache layout needs {self.end} bytes but the buffer holds {buffer.nbytes}")
        offsets = tuple((self.main_offset(i), self.indexer_offset(i)) for i in range(self.num_layers))
        ib = self.indexer.block_bytes
        return Placement(offsets, self.block_size * MainKVLayout.TOKEN_BYTES, ib, self)

    # ------------------------------------------------------------------ host views
    def main_kv(self, buffer, layer: int, rank: int | None = None) -> torch.Tensor:
        """``uint8 [num_blocks, block_size, 656]`` view of a layer's main KV (no copy)."""
        t = buffer.tensor(self.main_offset(layer), (self.num_slots * MainKVLayout.TOKEN_BYTES,), torch.uint8, rank)
        return t.view(self.num_blocks, self.block_size, MainKVLayout.TOKEN_BYTES)

    def indexer_k(self, buffer, layer: int, rank: int | None = None) -> torch.Tensor:
        """``uint8 [num_blocks, block_size * 132]`` view of a layer's indexer K (no copy)."""
        ib = self.indexer.block_bytes
        t = buffer.tensor(self.indexer_offset(layer), (self.num_blocks * ib,), torch.uint8, rank)
        return t.view(self.num_blocks, ib)

    def layer_backing(self, buffer, layer: int, rank: int | None = None) -> torch.Tensor:
        """``uint8`` view of a layer's whole backing (both regions and their padding)."""
        return buffer.tensor(self.main_offset(layer), (self.layer_bytes,), torch.uint8, rank)


@dataclass(frozen=True)
class Placement:
    """Byte offsets of every layer's caches from each member's base, and the block strides:
    what the writer's kernel needs, and what the members of a PCP group must agree on.

    Attributes:
        offsets: ``(main-KV offset, indexer-K offset)`` per layer.
        main_block_stride: bytes from one main-KV block to the next.
        indexer_block_stride: bytes from one indexer-K block to the next (at least
            ``block_size * 132``; a runtime may pad it).
        caches: the :class:`CacheLayout` or :class:`CacheTensors` it describes.
    """

    offsets: tuple[tuple[int, int], ...]
    main_block_stride: int
    indexer_block_stride: int
    caches: CacheLayout | CacheTensors = field(compare=False, repr=False)

    def spans(self) -> list[tuple[int, int]]:
        """The byte ranges the caches cover, ``(start, stop)``, sorted, touching ones joined."""
        c = self.caches
        last_main = (c.num_blocks - 1) * self.main_block_stride + c.block_size * MainKVLayout.TOKEN_BYTES
        last_indexer = (c.num_blocks - 1) * self.indexer_block_stride + c.block_size * IndexerKLayout.TOKEN_BYTES
        ranges = sorted(r for m, x in self.offsets for r in ((m, m + last_main), (x, x + last_indexer)))
        joined: list[tuple[int, int]] = []
        for start, stop in ranges:
            if joined and start <= joined[-1][1]:
                joined[-1] = (joined[-1][0], max(stop, joined[-1][1]))
            else:
                joined.append((start, stop))
        return joined

    def agreed(self) -> tuple:
        """What every member must hold the same (compared across ranks)."""
        c = self.caches
        return (
            c.num_blocks,
            c.block_size,
            c.main_scale,
            c.indexer_scale,
            self.offsets,
            self.main_block_stride,
            self.indexer_block_stride,
        )


class CacheTensors(_Layers):
    """This rank's per-layer cache tensors, as a runtime holds them, for the writer.

    Args:
        main: per layer, the main-KV cache: ``uint8 [num_blocks, block_size, 656]``, each
            token's 656 bytes contiguous (a block stride past ``block_size * 656`` is kept).
        indexer: per layer, the indexer-K cache: ``uint8 [num_blocks, block_stride]``
            with ``block_stride >= block_size * 132`` (a padded block stride is kept).
        main_scale: the main-KV scale format, as for :class:`CacheLayout`.
        indexer_scale: the indexer-K scale format, as for :class:`CacheLayout`.

    Every tensor must lie inside the symmetric buffer the writer's view is over (memory
    symmsync allocated, or a runtime's registered memory), at offsets that are
    multiples of 16, with the same block strides in every layer; and the members of a
    PCP group must hold theirs at the same offsets. The writer checks all of it, on
    every rank. :class:`CacheLayout` is one convenient way to place such tensors.

    Raises:
        ConfigError: a tensor of the wrong dtype, rank or geometry, or layers that
            disagree (the message names the layer and the tensor).
    """

    def __init__(
        self,
        main: Sequence[torch.Tensor],
        indexer: Sequence[torch.Tensor],
        *,
        main_scale: str = "pow2",
        indexer_scale: str = "ue8m0",
    ):
        main, indexer = list(main), list(indexer)
        if not main or len(main) != len(indexer):
            raise ConfigError(
                f"CacheTensors: pass one main-KV and one indexer-K tensor per layer, got {len(main)} and {len(indexer)}"
            )
        problem = _formats_problem(main_scale, indexer_scale)
        if problem is not None:
            raise ConfigError(f"CacheTensors: {problem}")
        for i, (m, x) in enumerate(zip(main, indexer)):
            for name, t, dims in (("main", m, 3), ("indexer", x, 2)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != dims:
                    raise ConfigError(f"CacheTensors: layer {i}'s {name} tensor must be a {dims}-D uint8 tensor")
        m0 = main[0]
        self.block_size = m0.shape[1]
        self.num_blocks = m0.shape[0]
        if self.block_size < 1 or self.num_blocks < 1:
            raise ConfigError(f"CacheTensors: layer 0's main tensor holds no block, shape {tuple(m0.shape)}")
        self.main_scale, self.indexer_scale = main_scale, indexer_scale
        token = MainKVLayout.TOKEN_BYTES
        need = self.block_size * IndexerKLayout.TOKEN_BYTES
        self.main_block_stride, self.indexer_block_stride = m0.stride(0), indexer[0].stride(0)
        for i, (m, x) in enumerate(zip(main, indexer)):
            where = f"CacheTensors: layer {i}"
            if tuple(m.shape) != (self.num_blocks, self.block_size, token) or m.stride()[1:] != (token, 1):
                raise ConfigError(
                    f"{where}: main must be [{self.num_blocks}, {self.block_size}, {token}] with each token's "
                    f"bytes contiguous, got shape {tuple(m.shape)} strides {m.stride()}"
                )
            if x.shape[0] != self.num_blocks or x.shape[1] < need or x.stride(1) != 1 or x.stride(0) < need:
                raise ConfigError(
                    f"{where}: indexer must be [{self.num_blocks}, >= {need}] (block_size * 132 bytes per block), "
                    f"got shape {tuple(x.shape)} strides {x.stride()}"
                )
            if (m.stride(0), x.stride(0)) != (self.main_block_stride, self.indexer_block_stride):
                raise ConfigError(f"{where}: block strides differ from layer 0's; every layer must have the same")
            if m.stride(0) < self.block_size * token or m.stride(0) % 16 or x.stride(0) % 16:
                raise ConfigError(f"{where}: block strides must cover a block and be multiples of 16 bytes")
        self.main, self.indexer = main, indexer
        self.num_layers = len(main)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def placement(self, buffer: SymmetricBuffer) -> Placement:
        """The tensors' offsets in ``buffer``.

        Raises:
            BoundsError: a tensor lies outside the buffer's user region on this rank.
            ConfigError: a tensor's offset is not a multiple of 16.
        """
        offsets = []
        for i, (m, x) in enumerate(zip(self.main, self.indexer)):
            pair = []
            for name, t in (("main", m), ("indexer", x)):
                try:
                    off = buffer.offset_of(t)
                except BoundsError as e:
                    raise BoundsError(f"layer {i}'s {name} tensor is outside symmetric memory: {e}") from e
                if off % 16:
                    raise ConfigError(f"layer {i}'s {name} tensor starts {off} bytes in, not a multiple of 16")
                pair.append(off)
            offsets.append(tuple(pair))
        return Placement(tuple(offsets), self.main_block_stride, self.indexer_block_stride, self)

    def main_kv(self, buffer: SymmetricBuffer, layer: int, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s copy of a layer's main KV, with this rank's shape and strides (no copy)."""
        return self._replica(buffer, self.main[layer], rank)

    def indexer_k(self, buffer: SymmetricBuffer, layer: int, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s copy of a layer's indexer K (no copy)."""
        return self._replica(buffer, self.indexer[layer], rank)

    @staticmethod
    def _replica(buffer: SymmetricBuffer, t: torch.Tensor, rank: int | None) -> torch.Tensor:
        span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
        flat = buffer.tensor(buffer.offset_of(t), (span,), torch.uint8, rank)
        return flat.as_strided(t.shape, t.stride())

    def __repr__(self) -> str:
        return (
            f"CacheTensors({self.num_layers} layers, {self.num_blocks} blocks of {self.block_size}, "
            f"block strides {self.main_block_stride}/{self.indexer_block_stride}, "
            f"{self.main_scale}/{self.indexer_scale})"
        )


def layer_spans(buf, layout: CacheLayout | CacheTensors) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    """Per layer, the ``uint8`` tensor over this rank's bytes from the first to the last byte
    of its caches, and the caches as views of it: views of one base tensor, which
    functionalization needs to see that they alias (a graph input it mutates)."""
    user = user_views(buf)[buf.rank]
    spans, caches = [], []
    for layer in range(layout.num_layers):
        pair = layout.main_kv(buf, layer), layout.indexer_k(buf, layer)
        starts = [t.data_ptr() - user.data_ptr() for t in pair]
        lo = min(starts)
        spans.append(user[lo : max(at + t.numel() for at, t in zip(starts, pair))])
        caches.append(tuple(spans[-1][at - lo : at - lo + t.numel()].view(t.shape) for at, t in zip(starts, pair)))
    return spans, caches
