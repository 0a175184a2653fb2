"""HybridPrefixCache: a transformers ``Cache`` that keeps prefixes across ``generate()`` calls.

The object plays two parts. It is the live cache of the request that is running (its ``layers`` are the standard
transformers cache layers, so the model's own code reads and writes them), and it owns the stores that outlive a
request: a block pool with paged KV blocks and a checkpoint store. A ``generate()`` call is one request:

1. before prefill, the longest hit P is looked up (KV for every block of ``[0, P)`` and a checkpoint at P) and copied
   into fresh live layers, so ``generate()`` runs only the tail ``[P, L)``;
2. after every forward, new full blocks of live KV are stored, and the Mamba states at the retained block boundaries
   (captured by the patched mixers inside the forward, or read from the live layers at the forward's end) are stored
   as checkpoints.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from . import _compat
from .checkpoints import LayerState
from .config import DEFAULT_MAX_CACHE_BYTES, CacheOptions
from .hashing import BlockHash, model_identity, root_hash
from .kernels.paged_copy import scatter_kv_blocks
from .models import support_for
from .policy import last_boundary, retained_boundaries
from .store import PrefixStore

logger = logging.getLogger("hf_hybridcache")


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of a :class:`HybridPrefixCache` (a snapshot; token counts are summed over requests and rows).

    Attributes:
        requests: ``generate()`` calls (prefills) served.
        prompt_tokens: prompt tokens seen.
        hit_tokens: prompt tokens restored from the cache instead of computed.
        computed_prompt_tokens: prompt tokens run through the model (``prompt_tokens - hit_tokens``).
        kv_blocks: KV blocks stored now.
        checkpoints: checkpoints stored now.
        stored_bytes: bytes of stored KV blocks + checkpoints now.
        max_cache_bytes: the budget ``stored_bytes`` never exceeds.
        evicted_kv_blocks: KV blocks evicted so far.
        evicted_checkpoints: checkpoints evicted so far (also those dropped with their KV block).
    """

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    kv_blocks: int = 0
    checkpoints: int = 0
    stored_bytes: int = 0
    max_cache_bytes: int = 0
    evicted_kv_blocks: int = 0
    evicted_checkpoints: int = 0

    @property
    def token_hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0.0 before any request)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Request:
    """Bookkeeping of the request whose state is live."""

    prompt_tokens: int
    tracking: bool
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    storing: bool = True
    forward_start: int = 0
    forward_end: int = 0
    retained: frozenset[int] = frozenset()
    emit_positions: tuple[int, ...] = ()
    captured: dict[int, dict[int, LayerState]] = field(default_factory=dict)
    tentative_block: int | None = None


class HybridPrefixCache(Cache):
    """Cross-request prefix cache for hybrid attention + Mamba models; pass it to every ``generate()`` call.

    Example::

        cache = HybridPrefixCache(model)
        for prompt_ids in requests:
            out = model.generate(prompt_ids, past_key_values=cache, max_new_tokens=64)
            print(cache.last_hit_tokens, cache.stats.token_hit_rate)

    Args:
        model: a supported ``*ForCausalLM`` (see ``hf_hybridcache.models.supported_model_types()``). Constructing the
            cache patches this model instance's Mamba mixers and adds hooks to it; other models are not touched.
        block_size: tokens per KV block (int >= 1). Hits are multiples of it.
        retention_interval: checkpoints kept during a request besides the mandatory ones: ``"dense"`` (every block
            boundary), N (every N tokens, a multiple of ``block_size``) or 0 (none).
        max_cache_bytes: hard cap on stored KV blocks + checkpoints, in bytes; None means 2 GiB
            (``DEFAULT_MAX_CACHE_BYTES``).
        seed: bytes mixed into every block hash; random per cache when None.

    Raises:
        ValueError: unsupported model; invalid ``block_size``, ``retention_interval`` or ``max_cache_bytes``; a budget
            smaller than one KV block plus one checkpoint.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int = 16,
        retention_interval: int | str = 0,
        max_cache_bytes: int | None = None,
        *,
        seed: bytes | None = None,
    ) -> None:
        support = support_for(model)
        self.options = CacheOptions(
            block_size, retention_interval, DEFAULT_MAX_CACHE_BYTES if max_cache_bytes is None else max_cache_bytes
        )
        self.spec = support.state_spec(model, block_size)
        minimum = self.spec.kv_block_bytes + self.spec.checkpoint_bytes
        if self.options.max_cache_bytes < minimum:
            raise ValueError(
                f"`max_cache_bytes={self.options.max_cache_bytes}` cannot hold one KV block plus one checkpoint of "
                f"this model ({self.spec.kv_block_bytes} + {self.spec.checkpoint_bytes} bytes); pass at least "
                f"{minimum}, or None for the default of {DEFAULT_MAX_CACHE_BYTES} bytes."
            )
        self.model = model
        support.install(model)
        _compat.install_prefill_hook(model, _on_prefill)
        _compat.install_forward_hooks(model, _on_forward_pre, _on_forward_post)
        super().__init__(layers=_compat.new_live_layers(model.config))

        root = root_hash(os.urandom(32) if seed is None else seed, model_identity(model))
        self._store = PrefixStore(self.spec, root, self.options.max_cache_bytes)
        self._request: _Request | None = None
        self._counters = dict(requests=0, prompt_tokens=0, hit_tokens=0)
        self.last_hit_tokens: list[int] = []

    # ------------------------------------------------------------------ public API

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def max_cache_bytes(self) -> int:
        return self.options.max_cache_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of the stored KV blocks and checkpoints (never above ``max_cache_bytes``)."""
        return self._store.stored_bytes

    @property
    def stats(self) -> PrefixCacheStats:
        c = self._counters
        return PrefixCacheStats(
            requests=c["requests"],
            prompt_tokens=c["prompt_tokens"],
            hit_tokens=c["hit_tokens"],
            computed_prompt_tokens=c["prompt_tokens"] - c["hit_tokens"],
            kv_blocks=len(self._store.kv),
            checkpoints=len(self._store.checkpoints),
            stored_bytes=self.stored_bytes,
            max_cache_bytes=self.max_cache_bytes,
            evicted_kv_blocks=self._store.evicted_kv_blocks,
            evicted_checkpoints=self._store.evicted_checkpoints,
        )

    def reset(self) -> None:
        """End the live request and empty the live layers; stored blocks and checkpoints stay."""
        self._end_request()
        self.layers = _compat.new_live_layers(self.model.config)

    def clear(self) -> None:
        """Drop every stored KV block and checkpoint (and the live request). Counters of past requests stay."""
        self.reset()
        self._store.clear()

    @property
    def is_compileable(self) -> bool:
        return False

    # ------------------------------------------------------------------ guards on the live layers

    def _check_owner(self) -> None:
        if self._request is None or not self._in_forward:
            raise ValueError(
                f"This HybridPrefixCache was built for another model ({type(self.model).__name__} at "
                f"{id(self.model):#x}); build one HybridPrefixCache per model and pass it only to that model."
            )

    _in_forward = False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._check_owner()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states, layer_idx, *args, **kwargs):
        self._check_owner()
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    # ------------------------------------------------------------------ called by the patched mixers

    def checkpoint_positions(self, seq_len: int) -> tuple[int, ...]:
        """Token counts ``1 <= t < seq_len`` of the running forward after which a Mamba mixer must hand its state to
        :meth:`capture_states`. The state at the forward's end is read from the live layers instead."""
        request = self._request
        if request is None or not request.tracking or request.forward_end - request.forward_start != seq_len:
            return ()
        return request.emit_positions

    def capture_states(self, layer_idx: int, positions, states: list[LayerState]) -> None:
        """Receive one Mamba layer's (conv state ``[1, C, W]``, SSM state) copies after each of ``positions`` tokens
        of the running forward."""
        request = self._request
        for t, state in zip(positions, states):
            request.captured.setdefault(request.forward_start + t, {})[layer_idx] = state

    # ------------------------------------------------------------------ request life cycle

    def _begin_request(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, num_rows: int
    ) -> None:
        """Start a request: fresh live layers, then the lookup and restore of the longest hit (one row only)."""
        self._end_request()
        self.layers = _compat.new_live_layers(self.model.config)
        padded = attention_mask is not None and not bool((attention_mask == 1).all())
        tracking = input_ids is not None and num_rows == 1 and not padded
        if tracking:
            token_ids = input_ids[0].tolist()
            request = _Request(prompt_tokens=len(token_ids), tracking=True)
            hit_tokens = self._restore(request, token_ids)
            prompt_tokens = [len(token_ids)]
        else:
            request = _Request(prompt_tokens=0, tracking=False)
            hit_tokens = 0
            if input_ids is None:
                prompt_tokens = [0] * num_rows
            elif attention_mask is None:
                prompt_tokens = [input_ids.shape[1]] * num_rows
            else:
                prompt_tokens = attention_mask.sum(dim=1).tolist()
            logger.debug(
                "no prefix reuse for this call (%s); it runs like a fresh cache",
                "inputs_embeds without input_ids" if input_ids is None else f"{num_rows} rows or padding",
            )
        self._request = request
        self.last_hit_tokens = [hit_tokens] * num_rows
        c = self._counters
        c["requests"] += 1
        c["prompt_tokens"] += sum(prompt_tokens)
        c["hit_tokens"] += hit_tokens
        logger.debug(
            "request %d: %d prompt tokens, hit %d, replay %d",
            c["requests"],
            sum(prompt_tokens),
            hit_tokens,
            sum(prompt_tokens) - hit_tokens,
        )

    def _end_request(self) -> None:
        """Release the live request's blocks; its last decode-boundary checkpoint stays as the decode-end one."""
        request, self._request = self._request, None
        self._in_forward = False
        if request is None or not request.block_ids:
            return
        self._store.release(request.block_ids)

    def _restore(self, request: _Request, token_ids: list[int]) -> int:
        """Copy the longest stored prefix of ``token_ids`` into the (fresh) live layers; returns its length."""
        hit = self._store.lookup(token_ids)
        request.token_ids = token_ids[: hit.hit_tokens]
        request.forward_end = hit.hit_tokens
        if not hit.hit_tokens:
            return 0
        for attn in self.spec.attention:
            keys, values = self._store.gather_kv(attn.layer_idx, hit.block_ids)
            _compat.set_kv(self.layers[attn.layer_idx], keys, values)
        for layer_idx, (conv, ssm) in self._store.checkpoint_copy(hit.block_ids[-1]).items():
            _compat.set_linear_state(self.layers[layer_idx], conv, ssm)
        self._store.pin(hit.block_ids)
        request.block_ids, request.block_hashes = list(hit.block_ids), list(hit.block_hashes)
        return hit.hit_tokens

    # ------------------------------------------------------------------ around every forward

    def _before_forward(self, input_ids: torch.Tensor | None, num_rows: int, num_tokens: int) -> None:
        if self._request is None:  # a forward outside generate(): one request that starts with this forward
            self._request = _Request(prompt_tokens=num_tokens, tracking=num_rows == 1 and input_ids is not None)
        request = self._request
        self._in_forward = True
        request.captured.clear()
        request.forward_start = request.forward_end
        request.forward_end += num_tokens
        if not request.tracking:
            return
        if input_ids is None or num_rows != 1:
            request.tracking = False
            return
        request.token_ids.extend(input_ids[0].tolist())
        start, end, bs = request.forward_start, request.forward_end, self.block_size
        request.retained = frozenset(
            retained_boundaries(start, end, request.prompt_tokens, bs, self.options.retention_tokens)
        )
        # Besides the retained boundaries, the last boundary reached is wanted: it becomes the decode-end
        # checkpoint if the request stops before the next one.
        wanted = request.retained | {last_boundary(end, bs)}
        request.emit_positions = tuple(sorted(b - start for b in wanted if start < b < end))

    def _after_forward(self) -> None:
        request = self._request
        self._in_forward = False
        if request is None or not request.tracking:
            return
        self._store_blocks(request)
        end = request.forward_end
        if end % self.block_size == 0 and end > request.forward_start:
            request.captured[end] = {
                idx: tuple(t.clone() for t in _compat.get_linear_state(self.layers[idx]))
                for idx in self._store.checkpoints.mamba_layers
            }
        for boundary in sorted(request.captured):
            self._store_checkpoint(request, boundary, request.captured[boundary], boundary not in request.retained)
        request.captured.clear()

    # ------------------------------------------------------------------ storing under the budget

    def _store_blocks(self, request: _Request) -> None:
        """Store every full block of live KV not stored yet, pinned by the running request."""
        bs = self.block_size
        while request.storing and len(request.block_ids) < len(request.token_ids) // bs:
            index = len(request.block_ids)
            added = self._store.add_block(
                request.block_ids[-1] if index else None,
                request.block_hashes[-1] if index else None,
                tuple(request.token_ids[index * bs : (index + 1) * bs]),
                lambda: self._live_block_kv(index),
            )
            if added is None:
                request.storing = False
                logger.debug("KV block %d does not fit in the budget; the rest of this request is not stored", index)
                return
            request.block_ids.append(added[0])
            request.block_hashes.append(added[1])

    def _live_block_kv(self, index: int) -> dict[int, torch.Tensor]:
        """Copies of block ``index`` of the live KV: ``{attention layer idx: [2, Hkv, block_size, D]}``."""
        kv = {}
        for attn in self.spec.attention:
            keys, values = _compat.get_kv(self.layers[attn.layer_idx])
            kv[attn.layer_idx] = scatter_kv_blocks(keys, values, [index], self.block_size)[0]
        return kv

    def _store_checkpoint(self, request: _Request, boundary: int, states: dict[int, LayerState], tentative: bool):
        index = boundary // self.block_size - 1
        if index >= len(request.block_ids) or set(states) != set(self._store.checkpoints.mamba_layers):
            return
        block_id = request.block_ids[index]
        stored = self._store.add_checkpoint(block_id, states)
        if stored is None:
            logger.debug("checkpoint at %d tokens does not fit in the budget", boundary)
            return
        previous, request.tentative_block = request.tentative_block, (block_id if stored and tentative else None)
        if previous is not None and previous != block_id:
            # Beyond the retained boundaries, only the last boundary a request reaches keeps its checkpoint: the
            # decode-end checkpoint that lets the next chat turn reuse the reply.
            self._store.drop_checkpoint(previous)


# ---------------------------------------------------------------------- hooks installed on the model


def _cache_for(model, kwargs) -> HybridPrefixCache | None:
    cache = _compat.find_cache(kwargs)
    if not isinstance(cache, HybridPrefixCache):
        return None
    if cache.model is not model:
        raise ValueError(
            f"This HybridPrefixCache was built for another model ({type(cache.model).__name__} at "
            f"{id(cache.model):#x}) than the one it was passed to ({type(model).__name__} at {id(model):#x}); build "
            "one HybridPrefixCache per model."
        )
    return cache


def _on_prefill(model, input_ids, model_kwargs) -> None:
    cache = _cache_for(model, model_kwargs)
    if cache is None:
        return
    embeds = model_kwargs.get("inputs_embeds")
    if embeds is not None:
        cache._begin_request(None, None, embeds.shape[0])
    else:
        cache._begin_request(input_ids, model_kwargs.get("attention_mask"), input_ids.shape[0])


def _on_forward_pre(model, args, kwargs) -> None:
    cache = _cache_for(model, kwargs)
    if cache is None:
        return
    input_ids = _compat.forward_input_ids(args, kwargs)
    embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        cache._before_forward(input_ids, input_ids.shape[0], input_ids.shape[1])
    elif embeds is not None:
        cache._before_forward(None, embeds.shape[0], embeds.shape[1])


def _on_forward_post(model, kwargs) -> None:
    cache = _cache_for(model, kwargs)
    if cache is not None:
        cache._after_forward()
