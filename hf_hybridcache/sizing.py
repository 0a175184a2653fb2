"""What one checkpoint, one KV block and one cached token of a model cost, before choosing ``max_cache_bytes``.

The sizes come from the same per-layer state specs the cache stores by (:class:`~hf_hybridcache.config.ModelStateSpec`),
so they are the bytes the budget counts. Nothing is patched or allocated: a model built on the meta device
(``with torch.device("meta"): AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)``) is sized without
loading its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DEFAULT_MAX_CACHE_BYTES
from .models import support_for

#: The most checkpoints the defaults (``retention_interval=0``) keep for one request: two at the prompt's end (the last
#: block boundary at or below its length and the one strictly below it) and one at the end of the decode.
DEFAULT_CHECKPOINTS_PER_PREFIX = 3


@dataclass(frozen=True)
class CacheSizes:
    """Byte sizes of the entries a :class:`~hf_hybridcache.HybridPrefixCache` stores for one model.

    Attributes:
        block_size: tokens per KV block the sizes are for.
        kv_block_bytes: bytes of one stored KV block: keys and values of ``block_size`` tokens over every attention
            layer (sliding-window layers included, at the same size as full ones).
        checkpoint_bytes: bytes of one checkpoint: the conv window and recurrent state of every recurrent layer (in
            bf16 models the recurrent state usually stays float32).
        kv_bytes_per_token: ``kv_block_bytes / block_size``, bytes of attention KV per cached token.
        num_attention_layers: attention layers (each stores KV).
        num_state_layers: recurrent or short-conv layers (each adds its state to a checkpoint).
    """

    block_size: int
    kv_block_bytes: int
    checkpoint_bytes: int
    kv_bytes_per_token: int
    num_attention_layers: int
    num_state_layers: int

    def suggest_budget(
        self, num_prefixes: int, prefix_tokens: int, checkpoints_per_prefix: int = DEFAULT_CHECKPOINTS_PER_PREFIX
    ) -> int:
        """Bytes that hold ``num_prefixes`` distinct prefixes of ``prefix_tokens`` tokens each: their full KV blocks
        (``prefix_tokens // block_size`` per prefix) plus ``checkpoints_per_prefix`` checkpoints each.

        ``checkpoints_per_prefix`` defaults to the most the default options keep per request (3); with
        ``retention_interval="dense"`` a prefix keeps ``prefix_tokens // block_size`` of them, with an interval N
        about ``prefix_tokens // N`` more. Prefixes that share their start (a system prompt) share its blocks and
        checkpoints, so this is an upper bound for them. Pass the result as ``max_cache_bytes``.

        Raises:
            ValueError: a count that is not an int >= 0, or counts that hold nothing (a budget of 0 bytes, which
                ``max_cache_bytes`` refuses).
        """
        for name, value in (("num_prefixes", num_prefixes), ("prefix_tokens", prefix_tokens),
                            ("checkpoints_per_prefix", checkpoints_per_prefix)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be an int >= 0, got {value!r}.")
        per_prefix = (prefix_tokens // self.block_size) * self.kv_block_bytes
        budget = num_prefixes * (per_prefix + checkpoints_per_prefix * self.checkpoint_bytes)
        if not budget:
            raise ValueError(
                f"suggest_budget({num_prefixes}, {prefix_tokens}, checkpoints_per_prefix={checkpoints_per_prefix}) "
                f"holds nothing (0 bytes): count at least one prefix of at least one block ({self.block_size} tokens) "
                "or one checkpoint."
            )
        return budget

    def __str__(self) -> str:
        text = (
            f"KV block of {self.block_size} tokens: {_size(self.kv_block_bytes)} over {self.num_attention_layers} "
            f"attention layers ({self.kv_bytes_per_token:,} bytes per token); checkpoint: "
            f"{_size(self.checkpoint_bytes)} over {self.num_state_layers} state layers"
        )
        if self.checkpoint_bytes:
            text += (f"; the default budget of {_size(DEFAULT_MAX_CACHE_BYTES)} holds "
                     f"{DEFAULT_MAX_CACHE_BYTES // self.checkpoint_bytes:,} checkpoints")
        return text


def sizes(model: torch.nn.Module, block_size: int = 16) -> CacheSizes:
    """Bytes per KV block, per checkpoint and per cached token of ``model`` (a supported ``*ForCausalLM``, in the
    dtype it will run in; the meta device is fine) with blocks of ``block_size`` tokens.

    Example::

        s = hf_hybridcache.sizes(model)
        print(s)                                              # the sizes in MiB
        cache = HybridPrefixCache(model, max_cache_bytes=s.suggest_budget(100, 2_000))

    Raises:
        ValueError: the model is not a supported hybrid; ``block_size`` is not an int >= 1, or is longer than a
            sliding attention window of the model.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"`block_size` must be an int >= 1 (tokens per KV block), got {block_size!r}.")
    spec = support_for(model).spec_for(model, block_size)
    return CacheSizes(
        block_size=block_size,
        kv_block_bytes=spec.kv_block_bytes,
        checkpoint_bytes=spec.checkpoint_bytes,
        kv_bytes_per_token=spec.kv_block_bytes // block_size,
        num_attention_layers=len(spec.attention),
        num_state_layers=len({m.layer_idx for m in spec.mamba}),
    )


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes} bytes"
