"""Trace simulator: replay a workload through HybridPrefixCache's own bookkeeping without running the model.

The model is built from a real-size config on the meta device (no memory, no compute), so the cache sees the real
per-layer state shapes: KV block and checkpoint byte sizes, the FLOP model, the layer layout. For every request the
simulator does what ``generate()`` and the model would do to the cache:

1. ``_begin_request`` (the prefill hook): lookup, divergence detection, restore of KV and checkpoint (meta copies);
2. one forward over the uncached prompt tail, then one forward per generated token except the last (the last
   sampled token never goes through the model); around each forward, ``_before_forward`` / ``_after_forward`` (the
   forward hooks), and in between what the model writes: the KV of the new tokens through ``cache.update`` and the
   Mamba states the cache asked for through ``capture_states`` — meta tensors of the real shapes and dtypes;
3. the end of ``generate()``: the replay of the reply (:mod:`hf_hybridcache.generate.reply_replay`, on by default for
   the bfloat16 models), whose forward is played the same way.

So the lookup, admission, retention, eviction and budget code that runs is the cache's own; only the numbers inside
the tensors are missing, and hit rates do not depend on them. Two tensor copies of the cache are swapped for
allocations of the same shapes and dtypes on this cache instance — cutting a block of live KV and gathering the KV of
a hit — because ``torch.stack``/``torch.cat`` of meta tensors run in Python and would take most of the replay time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import torch
from transformers import AutoModelForCausalLM, JambaConfig

from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.config import split_state_key
from hf_hybridcache.generate import lifecycle, replay_replies
from hf_hybridcache.store import FlopModel


def jamba_mini_config() -> JambaConfig:
    """A Jamba-1.5-Mini-sized config (52B parameters, 12B active; 32 layers, one attention layer in 8, 16 experts
    top-2 on every other layer), written out so no hub access is needed."""
    return JambaConfig(
        vocab_size=65536,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        attn_layer_period=8,
        attn_layer_offset=4,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=16,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=256,
        max_position_embeddings=262144,
    )


def meta_model(config, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """``config``'s causal LM with every parameter on the meta device."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@dataclass(frozen=True)
class TraceRequest:
    """One request: prompt token ids and the tokens generate() samples for it (the reply and EOS)."""

    prompt_ids: list[int]
    generated_ids: list[int]


def tokenize_workload(dataset: datasets.Dataset, tokenizer) -> list[TraceRequest]:
    """Prompts rendered with the tokenizer's chat template (generation prompt appended); generated = reply + EOS."""
    requests = []
    for row in dataset:
        prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        reply = tokenizer(row["reply"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        requests.append(TraceRequest(list(prompt), reply))
    return requests


@dataclass
class SimulationResult:
    """Hits and storage of one replay.

    Attributes:
        hits, replays, prompt_lengths: per request, restored tokens, tokens run at prefill and prompt length.
        peak_stored_bytes: the most bytes stored at the end of any request.
        stats: the cache's :class:`~hf_hybridcache.PrefixCacheStats` after the last request.
        flop_hit_rate: prefill FLOPs restored instead of computed, over all prompts' prefill FLOPs.
    """

    hits: list[int] = field(default_factory=list)
    replays: list[int] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    peak_stored_bytes: int = 0
    stats: object = None
    flop_hit_rate: float = 0.0


class CacheDriver:
    """Plays ``generate()`` and the model towards one HybridPrefixCache, with meta tensors."""

    def __init__(self, cache: HybridPrefixCache) -> None:
        self.cache = cache
        spec = cache.spec
        self._kv = {a.layer_idx: (a.num_kv_heads, (a.head_dim, a.value_head_dim), a.dtype) for a in spec.attention}
        self._states = {
            m.key: (torch.empty(1, *m.conv.shape, dtype=m.conv.dtype, device="meta"),
                          torch.empty(1, *m.ssm.shape, dtype=m.ssm.dtype, device="meta"))
            for m in spec.mamba
        }
        bs = spec.block_size
        self._block = {idx: tuple(torch.empty(heads, bs, dim, dtype=dtype, device="meta") for dim in dims)
                       for idx, (heads, dims, dtype) in self._kv.items()}
        cache.store.gather_kv = self._gather_kv

    def _gather_kv(self, layer_idx: int, block_ids, room_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta keys and values of the blocks (no room after them: the simulator runs no forward)."""
        return self._meta_kv(layer_idx, len(block_ids) * self.cache.block_size)

    def _meta_kv(self, layer_idx: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        heads, dims, dtype = self._kv[layer_idx]
        keys, values = (torch.empty(1, heads, num_tokens, dim, dtype=dtype, device="meta") for dim in dims)
        return keys, values

    def request(self, prompt_ids: list[int], generated_ids: list[int]) -> int:
        """Serve one request; returns its hit (restored tokens)."""
        cache = self.cache
        lifecycle.start_request(cache, torch.tensor([prompt_ids]), None, 1)
        hit = cache.last_hit_tokens[0]
        self.forward(prompt_ids[hit:])
        for token in generated_ids[:-1]:
            self.forward([token])
        replay_replies(cache, lambda model, input_ids, cache: self.forward(input_ids[0].tolist()))
        return hit

    def forward(self, token_ids: list[int]) -> None:
        cache, num_tokens = self.cache, len(token_ids)
        request = cache.live.request
        request._live_block_kv = lambda row, pad, block: {
            idx: (keys.clone(), values.clone()) for idx, (keys, values) in self._block.items()
        }
        for key, (conv, ssm) in self._states.items():  # a miss starts without states
            layer_idx, state_idx = split_state_key(key)
            if _compat.get_linear_state(cache.layers[layer_idx], state_idx) is None:
                _compat.set_linear_state(cache.layers[layer_idx], conv, ssm, state_idx, request.forward_end)
        request.before_forward(torch.tensor([token_ids]), 1, num_tokens)
        positions = cache.checkpoint_positions(num_tokens)
        # The model appends the new tokens' KV; a fresh meta tensor of the new length stands for that (torch.cat
        # on meta tensors costs tens of microseconds in Python and would dominate the replay).
        for layer_idx in self._kv:
            layer = cache.layers[layer_idx]
            kv = _compat.get_kv(layer)
            length = (0 if kv is None else kv[0].shape[2]) + num_tokens
            _compat.set_kv(layer, *self._meta_kv(layer_idx, length))
        if positions:
            for key, state in self._states.items():
                cache.capture_states(key, positions, [state] * len(positions))
        request.after_forward()


def simulate(model, requests: list[TraceRequest], **cache_kwargs) -> SimulationResult:
    """Replay ``requests`` in order through a new ``HybridPrefixCache(model, **cache_kwargs)``."""
    cache = HybridPrefixCache(model, seed=b"simulation", **cache_kwargs)
    return replay(cache, requests)


def replay(cache: HybridPrefixCache, requests: list[TraceRequest]) -> SimulationResult:
    driver = CacheDriver(cache)
    result = SimulationResult()
    flops = FlopModel.from_model(cache.model, cache.spec)
    saved = total = 0.0
    for request in requests:
        hit = driver.request(request.prompt_ids, request.generated_ids)
        length = len(request.prompt_ids)
        result.hits.append(hit)
        result.replays.append(length - hit)
        result.prompt_lengths.append(length)
        result.peak_stored_bytes = max(result.peak_stored_bytes, cache.stored_bytes)
        saved += flops.prefill_flops(hit)
        total += flops.prefill_flops(length)
    cache.reset()
    result.stats = cache.stats
    result.flop_hit_rate = saved / total if total else 0.0
    return result
