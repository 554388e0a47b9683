"""Byte layouts of the DeepSeek-V3.2 sparse-MLA caches on a packed symmetric backing.

Slots: ``slot = block * block_size + offset`` (block size 64 by default); slot -1 is
padding and is never written.

Main KV, "fp8_ds_mla", 656 bytes per token, at ``slot * 656`` in the layer's main region::

    [0, 512)     512 kv_c values, float8_e4m3fn, in 4 tiles of 128
    [512, 528)   4 fp32 tile scales, one per tile (``main_scale`` picks the rule)
    [528, 656)   64 k_pe values, bf16, unquantized

Indexer K, 132 bytes per token, laid out per block in the layer's indexer region::

    block * (block_size * 132) + offset * 128                      128 fp8 values
    block * (block_size * 132) + block_size * 128 + offset * 4     4-byte scale field

Scale formats (``CacheLayout(main_scale=..., indexer_scale=...)``); ``amax`` is the
largest ``|x|`` of a tile (main KV) or token (indexer), divisions are IEEE fp32, and
codes are ``e4m3fn(x / s)`` rounded to nearest even, saturating at +-448:

``main_scale="pow2"`` (default; vLLM >= 0.33, FlashMLA; exact for the SM90 reader,
which turns scales into bf16, and the SM100 reader, which turns them into E8M0)
    ``s`` = the smallest power of two >= ``max(amax / 448, 1e-4)``.
``main_scale="fp32"`` (vLLM <= 0.11)
    ``s = max(amax / 448, FLT_MIN)``.
``indexer_scale="ue8m0"`` (default; DeepSeek-V3.2)
    ``s`` = the smallest power of two >= ``max(amax, 1e-4) / 448``, stored as fp32.
``indexer_scale="fp32"`` (vLLM 0.33)
    ``s = max(amax, 1e-4) / 448``, stored as fp32.
``indexer_scale="mxfp8"`` (vLLM 0.33)
    ``s`` as for ``"ue8m0"``; the field holds its biased exponent byte (E8M0) 4 times.

One layer's backing is its main region then its indexer region, each padded to
128 bytes; layers follow each other from ``base`` in the symmetric buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .quant import INDEXER_DIM, INDEXER_SCALES, MAIN_SCALES, MLA_NOPE_DIM, MLA_ROPE_DIM, MLA_TILE, MLA_TOKEN_BYTES

_ALIGN = 128


def _up(x: int, m: int = _ALIGN) -> int:
    return (x + m - 1) // m * m


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
    TOKEN_BYTES = INDEXER_DIM + 4  #: 132

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise ConfigError(f"IndexerKLayout: block_size must be a positive int, got {self.block_size!r}")

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
        return block * self.block_bytes + self.block_size * self.DIM + off * 4


@dataclass(frozen=True)
class CacheLayout:
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
        ConfigError: a size is not a positive int, ``base`` is misaligned, or a
            format is not one of :data:`MAIN_SCALES` / :data:`INDEXER_SCALES`.
    """

    num_blocks: int
    num_layers: int = 1
    block_size: int = 64
    base: int = 0
    main_scale: str = "pow2"
    indexer_scale: str = "ue8m0"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"CacheLayout: {name} must be a positive int, got {v!r}")
        if not isinstance(self.base, int) or isinstance(self.base, bool) or self.base < 0 or self.base % _ALIGN:
            raise ConfigError(f"CacheLayout: base must be a non-negative multiple of {_ALIGN}, got {self.base!r}")
        if self.main_scale not in MAIN_SCALES:
            raise ConfigError(f"CacheLayout: main_scale must be one of {MAIN_SCALES}, got {self.main_scale!r}")
        if self.indexer_scale not in INDEXER_SCALES:
            raise ConfigError(f"CacheLayout: indexer_scale must be one of {INDEXER_SCALES}, got {self.indexer_scale!r}")

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

    def check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer!r} is out of range for a cache of {self.num_layers} layers")

    def main_offset(self, layer: int) -> int:
        """Byte offset of a layer's main-KV region in the buffer."""
        self.check_layer(layer)
        return self.base + layer * self.layer_bytes

    def indexer_offset(self, layer: int) -> int:
        """Byte offset of a layer's indexer-K region in the buffer."""
        return self.main_offset(layer) + self.main_bytes

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
