"""Frozen option and state-spec dataclasses.

Shape legend used across the package: B batch, T tokens, H heads, Hkv kv heads, D head dim (Dk / Dv where keys and
values differ), I mamba intermediate channels, C conv channels, W conv width (``d_conv``), N SSM state size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

#: Default hard cap on stored KV blocks + checkpoints when ``max_cache_bytes=None``: 2 GiB.
DEFAULT_MAX_CACHE_BYTES = 2 * 1024**3


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one stored tensor (without the batch dimension)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * _dtype_bytes(self.dtype)


#: Key of one stored state in a checkpoint: the layer index, or ``(layer idx, state idx)`` for a layer's second and
#: later states (transformers' ``state_idx``; Inkling keeps four short-conv states per layer).
StateKey = int | tuple[int, int]


def state_key(layer_idx: int, state_idx: int = 0) -> StateKey:
    return layer_idx if state_idx == 0 else (layer_idx, state_idx)


def split_state_key(key: StateKey) -> tuple[int, int]:
    """``(layer idx, state idx)`` of a :data:`StateKey`."""
    return key if isinstance(key, tuple) else (key, 0)


@dataclass(frozen=True)
class MambaLayerSpec:
    """State of one Mamba layer: conv state ``[C, W]`` and SSM state (``[I, N]`` for Mamba-1).

    ``state_idx`` tells which of a layer's states it is when the layer keeps several (transformers' ``state_idx``).
    """

    layer_idx: int
    conv: TensorSpec
    ssm: TensorSpec
    state_idx: int = 0

    @property
    def key(self) -> StateKey:
        """The key of this state in a checkpoint."""
        return state_key(self.layer_idx, self.state_idx)

    @property
    def name(self) -> str:
        """``"<layer idx>"``, or ``"<layer idx>.<state idx>"`` for a layer's later states (saved tensor names)."""
        return str(self.layer_idx) if self.state_idx == 0 else f"{self.layer_idx}.{self.state_idx}"

    @property
    def num_bytes(self) -> int:
        return self.conv.num_bytes + self.ssm.num_bytes


@dataclass(frozen=True)
class AttentionLayerSpec:
    """KV of one attention layer: one block holds keys ``[Hkv, block_size, D]`` and values ``[Hkv, block_size, Dv]``.

    ``value_head_dim`` (``Dv``) defaults to ``head_dim``; it differs where a layer caches keys and values of other
    widths, such as MLA layers, which cache a compressed latent as keys and a shared rope key as values
    (:func:`~hf_hybridcache.models.base.mla_attention_layer_spec`).

    ``sliding_window`` is set for a sliding-window (or chunked) attention layer, whose live cache layer keeps only the
    last ``sliding_window - 1`` tokens' KV (transformers' ``DynamicSlidingWindowLayer``). Its blocks are stored like a
    full layer's, so they cost the same bytes per token, and a hit at P restores only the blocks that hold the last
    ``sliding_window - 1`` tokens before P.
    """

    layer_idx: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    value_head_dim: int | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.value_head_dim is None:
            object.__setattr__(self, "value_head_dim", self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one stored block of this layer (keys and values)."""
        return self.num_kv_heads * block_size * (self.head_dim + self.value_head_dim) * _dtype_bytes(self.dtype)

    def restore_from_block(self, hit_tokens: int, block_size: int) -> int:
        """Index of the first stored block a restore at ``hit_tokens`` needs (0 for a full attention layer)."""
        if self.sliding_window is None:
            return 0
        return max(0, hit_tokens - (self.sliding_window - 1)) // block_size


@dataclass(frozen=True)
class ModelStateSpec:
    """Which layers hold KV and which hold Mamba state, and how big a KV block and a checkpoint are."""

    attention: tuple[AttentionLayerSpec, ...]
    mamba: tuple[MambaLayerSpec, ...]
    block_size: int

    @functools.cached_property
    def sliding_layers(self) -> frozenset[int]:
        """Indices of the sliding-window attention layers."""
        return frozenset(a.layer_idx for a in self.attention if a.sliding_window is not None)

    @functools.cached_property
    def kv_block_bytes(self) -> int:
        """Bytes of one stored KV block over all attention layers."""
        return sum(a.block_bytes(self.block_size) for a in self.attention)

    @functools.cached_property
    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint (conv + SSM state of every Mamba layer)."""
        return sum(m.num_bytes for m in self.mamba)

    def with_sliding_windows(self, windows: dict[int, int]) -> ModelStateSpec:
        """This spec with ``sliding_window`` set on the attention layers in ``windows`` (``{layer idx: window}``)."""
        attention = tuple(dataclasses.replace(a, sliding_window=windows.get(a.layer_idx)) for a in self.attention)
        return dataclasses.replace(self, attention=attention)

    def check_block_size(self) -> None:
        """Raises ``ValueError`` when a block is longer than a sliding window: the live sliding layer would have
        dropped the start of a block before the block is full and stored."""
        windows = [a.sliding_window for a in self.attention if a.sliding_window is not None]
        if windows and self.block_size > min(windows):
            raise ValueError(
                f"`block_size={self.block_size}` is longer than this model's sliding attention window of "
                f"{min(windows)} tokens, so a block's KV leaves the window before the block is stored; pass "
                f"block_size <= {min(windows)}."
            )

    def check_budget(self, max_cache_bytes: int) -> None:
        """Raises ``ValueError`` when ``max_cache_bytes`` cannot hold one KV block plus one checkpoint."""
        minimum = self.kv_block_bytes + self.checkpoint_bytes
        if max_cache_bytes < minimum:
            raise ValueError(
                f"`max_cache_bytes={max_cache_bytes}` cannot hold one KV block plus one checkpoint of this model "
                f"({self.kv_block_bytes} + {self.checkpoint_bytes} bytes); pass at least {minimum}, or None for the "
                f"default of {DEFAULT_MAX_CACHE_BYTES} bytes."
            )


@dataclass(frozen=True)
class CacheOptions:
    """Validated options of a :class:`~hf_hybridcache.HybridPrefixCache`.

    Raises:
        ValueError: ``block_size`` is not an int >= 1; ``retention_interval`` is not ``"dense"``, ``0`` or a positive
            multiple of ``block_size``; ``max_cache_bytes`` is not ``None`` or a positive int; ``admit_divergence``
            is not a bool; ``eviction`` is not ``"lru"`` or ``"flop_aware"``; ``replay_replies`` is not a bool.
    """

    block_size: int = 16
    retention_interval: int | str = 0
    max_cache_bytes: int = field(default=DEFAULT_MAX_CACHE_BYTES)
    admit_divergence: bool = True
    eviction: str = "flop_aware"
    replay_replies: bool = False

    def __post_init__(self) -> None:
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"`block_size` must be an int >= 1 (tokens per KV block), got {bs!r}.")
        ri = self.retention_interval
        if ri != "dense":
            if isinstance(ri, bool) or not isinstance(ri, int) or ri < 0 or ri % bs != 0:
                raise ValueError(
                    f"`retention_interval` must be 'dense' (a checkpoint at every block boundary), 0 (only the "
                    f"mandatory prompt-end and decode-end checkpoints) or a positive multiple of block_size={bs} "
                    f"(tokens between checkpoints), got {ri!r}."
                )
        mb = self.max_cache_bytes
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            raise ValueError(
                f"`max_cache_bytes` must be None (default {DEFAULT_MAX_CACHE_BYTES} bytes) or a positive int of "
                f"bytes, got {mb!r}."
            )
        if not isinstance(self.admit_divergence, bool):
            raise ValueError(
                f"`admit_divergence` must be True (keep a checkpoint where a prompt leaves a stored token path) or "
                f"False, got {self.admit_divergence!r}."
            )
        if self.eviction not in ("lru", "flop_aware"):
            raise ValueError(
                f"`eviction` must be 'flop_aware' (recency plus prefill FLOPs saved per byte) or 'lru' (least "
                f"recently used first), got {self.eviction!r}."
            )
        if not isinstance(self.replay_replies, bool):
            raise ValueError(
                f"`replay_replies` must be True (store a reply's KV and checkpoints from one prefill of its tokens), "
                f"False (store what the decode steps computed) or None (the default for the model's dtype), got "
                f"{self.replay_replies!r}."
            )

    @property
    def retention_tokens(self) -> int:
        """Tokens between retained checkpoints: ``block_size`` for "dense", 0 for none."""
        return self.block_size if self.retention_interval == "dense" else int(self.retention_interval)

    @property
    def min_tail_tokens(self) -> int:
        """Prompt tokens a hit leaves to run: 1, or 2 when replies are replayed, so that the tail goes through the
        mixers' prefill kernels (a one-token forward over a cached state takes their decode step, which rounds
        differently in bfloat16 and float16)."""
        return 2 if self.replay_replies else 1
