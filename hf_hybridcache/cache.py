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

import contextlib
import copy
import logging
import os
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache

from . import _compat
from .config import DEFAULT_MAX_CACHE_BYTES, CacheOptions
from .flops import FlopModel
from .hashing import model_identity, root_hash
from .kernels.paged_copy import scatter_kv_blocks
from .models import support_for
from .placement import Placement, layer_devices
from .request import Request, Row, store_row_blocks, store_row_checkpoint
from .sharing import SharedState
from .store import LayerState, PrefixStore, last_boundary, make_eviction, retained_boundaries

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
        stored_bytes: bytes of stored KV blocks + checkpoints now (``kv_bytes + checkpoint_bytes``).
        kv_bytes: bytes of the stored KV blocks now.
        checkpoint_bytes: bytes of the stored checkpoints now.
        max_cache_bytes: the budget ``stored_bytes`` never exceeds.
        evicted_kv_blocks: KV blocks evicted so far.
        evicted_checkpoints: checkpoints evicted so far.
        divergence_checkpoints: checkpoints admitted at divergence points so far.
    """

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    kv_blocks: int = 0
    checkpoints: int = 0
    stored_bytes: int = 0
    kv_bytes: int = 0
    checkpoint_bytes: int = 0
    max_cache_bytes: int = 0
    evicted_kv_blocks: int = 0
    evicted_checkpoints: int = 0
    divergence_checkpoints: int = 0

    @property
    def token_hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0.0 before any request)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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
            (``DEFAULT_MAX_CACHE_BYTES``). Can be changed later by assigning ``cache.max_cache_bytes``.
        seed: bytes mixed into every block hash; random per cache when None (pass the same bytes for reproducible
            hashes). :meth:`save` keeps it, so a loaded cache computes the same hashes.
        offload: None keeps stored entries on the device of the layer that made them; ``"cpu"`` keeps them in host
            memory (page-locked for CUDA layers) and copies them to the layer's device on restore.
        admit_divergence: when a prompt leaves an already stored token path, keep a checkpoint at the last block
            boundary of the shared part, taken inside the same prefill, so the shared prefix is reusable from the next
            request on (Marconi's admission rule).
        eviction: ``"flop_aware"`` (evict the lowest recency + alpha x prefill FLOPs saved per byte, after Marconi)
            or ``"lru"`` (least recently used first). Either way a KV block goes only after the blocks that extend it
            and after its own checkpoint, and the running request's blocks never go.

    Threads: ``generate()`` calls with one cache (or its :meth:`with_salt` views) from several threads run one at a
    time under the cache's lock; see :mod:`hf_hybridcache.sharing`.

    Raises:
        ValueError: unsupported model; invalid ``block_size``, ``retention_interval``, ``max_cache_bytes``, ``seed``,
            ``offload``, ``admit_divergence`` or ``eviction``; a budget smaller than one KV block plus one checkpoint.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int = 16,
        retention_interval: int | str = 0,
        max_cache_bytes: int | None = None,
        *,
        seed: bytes | None = None,
        offload: str | None = None,
        admit_divergence: bool = True,
        eviction: str = "flop_aware",
    ) -> None:
        support = support_for(model)
        options = CacheOptions(
            block_size,
            retention_interval,
            DEFAULT_MAX_CACHE_BYTES if max_cache_bytes is None else max_cache_bytes,
            admit_divergence,
            eviction,
        )
        if seed is not None and not isinstance(seed, bytes):
            raise ValueError(
                f"`seed` must be bytes (e.g. b'my-app') or None for a random one, got {type(seed).__name__}."
            )
        self.spec = support.state_spec(model, block_size)
        self._check_budget(options.max_cache_bytes)
        devices = layer_devices(model, [layer.layer_idx for layer in (*self.spec.attention, *self.spec.mamba)])
        placement = Placement(devices, offload)
        self.model = model
        support.install(model)
        _compat.install_request_hooks(model, _on_request, _on_generate)
        _compat.install_forward_hooks(model, _on_forward_pre, _on_forward_post)
        super().__init__(layers=_compat.new_live_layers(model.config))

        seed = os.urandom(32) if seed is None else seed
        identity = model_identity(model)
        self._shared = SharedState(seed, identity, model.dtype, devices, options)
        policy = make_eviction(options.eviction, FlopModel.from_model(model, self.spec))
        self._store = PrefixStore(self.spec, root_hash(seed, identity), options.max_cache_bytes, placement, policy)
        self._counters = dict(requests=0, prompt_tokens=0, hit_tokens=0, divergence_checkpoints=0)
        self._evicted_before_request = (0, 0)
        self._start_view(None)

    def _start_view(self, salt: str | None) -> None:
        """Give this object its own (empty) live state for requests under ``salt``."""
        self.salt = salt
        self._root = root_hash(self._shared.seed, self._shared.identity, salt)
        self._request: Request | None = None
        self._in_forward = self._awaiting_request = self._rollback_next_request = False
        self.last_hit_tokens: list[int] = []

    def _check_budget(self, max_cache_bytes: int) -> None:
        minimum = self.spec.kv_block_bytes + self.spec.checkpoint_bytes
        if max_cache_bytes < minimum:
            raise ValueError(
                f"`max_cache_bytes={max_cache_bytes}` cannot hold one KV block plus one checkpoint of "
                f"this model ({self.spec.kv_block_bytes} + {self.spec.checkpoint_bytes} bytes); pass at least "
                f"{minimum}, or None for the default of {DEFAULT_MAX_CACHE_BYTES} bytes."
            )

    # ------------------------------------------------------------------ public API

    @property
    def options(self) -> CacheOptions:
        return self._shared.options

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def max_cache_bytes(self) -> int:
        return self.options.max_cache_bytes

    @max_cache_bytes.setter
    def max_cache_bytes(self, max_cache_bytes: int | None) -> None:
        """Change the budget; when it shrinks, the entries the eviction policy ranks lowest are evicted at once. Waits
        for a running call in another thread.

        Raises:
            ValueError: not None or a positive int, or smaller than one KV block plus one checkpoint.
            RuntimeError: called from inside a running ``generate()`` in this thread.
        """
        value = DEFAULT_MAX_CACHE_BYTES if max_cache_bytes is None else max_cache_bytes
        options = replace(self.options, max_cache_bytes=value)
        self._check_budget(value)
        with self._shared.idle("Changing max_cache_bytes"):
            self._end_active_request()  # unpins the last request's chain, so everything above the budget can go
            self._store.max_cache_bytes = value
            fits = self._store.make_room(0)
            assert fits, "nothing is pinned between requests, so any budget of at least one entry fits"
            self._shared.options = options

    @property
    def stored_bytes(self) -> int:
        """Bytes of the stored KV blocks and checkpoints (never above ``max_cache_bytes``)."""
        return self._store.stored_bytes

    @property
    def stats(self) -> PrefixCacheStats:
        """Counters of this cache and all its :meth:`with_salt` views (they share one store)."""
        with self._shared.lock:
            return self._stats()

    def _stats(self) -> PrefixCacheStats:
        c = self._counters
        return PrefixCacheStats(
            requests=c["requests"],
            prompt_tokens=c["prompt_tokens"],
            hit_tokens=c["hit_tokens"],
            computed_prompt_tokens=c["prompt_tokens"] - c["hit_tokens"],
            kv_blocks=len(self._store.kv),
            checkpoints=len(self._store.checkpoints),
            stored_bytes=self.stored_bytes,
            kv_bytes=self._store.kv.num_bytes,
            checkpoint_bytes=self._store.checkpoints.num_bytes,
            max_cache_bytes=self.max_cache_bytes,
            evicted_kv_blocks=self._store.evicted_kv_blocks,
            evicted_checkpoints=self._store.evicted_checkpoints,
            divergence_checkpoints=c["divergence_checkpoints"],
        )

    def reset(self) -> None:
        """End the live request and empty the live layers; stored blocks and checkpoints stay. Waits for a running
        call in another thread.

        Raises:
            RuntimeError: called from inside a running ``generate()`` in this thread (it would empty that call's live
                layers).
        """
        with self._shared.idle("reset()"):
            self._end_request()
            self.layers = _compat.new_live_layers(self.model.config)

    def clear(self) -> None:
        """Drop every stored KV block and checkpoint (for all :meth:`with_salt` views) and the live request. Counters
        of past requests stay. Waits for a running call in another thread.

        Raises:
            RuntimeError: called from inside a running ``generate()`` in this thread.
        """
        with self._shared.idle("clear()"):
            self._end_active_request()
            self.layers = _compat.new_live_layers(self.model.config)
            self._store.clear()

    def with_salt(self, salt: str | None) -> HybridPrefixCache:
        """A view of this cache for one tenant: requests made with it only reuse prefixes stored by requests with the
        same salt (vLLM's ``cache_salt``), because the salt is mixed into the root of every block hash chain.

        The view shares the store, the budget, the counters and the lock with this cache, and has its own live
        state; it is cheap to make one per call::

            model.generate(ids, past_key_values=cache.with_salt(user_id), max_new_tokens=64)

        Args:
            salt: a non-empty string naming the tenant; None gives an unsalted view (shares with ``cache`` itself).

        Raises:
            ValueError: ``salt`` is not None or a non-empty string.
        """
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"`salt` must be a non-empty string naming the tenant, or None; got {salt!r}.")
        view = copy.copy(self)
        Cache.__init__(view, layers=_compat.new_live_layers(self.model.config))
        view._start_view(salt)
        return view

    def save(self, path: str | os.PathLike) -> None:
        """Write every stored KV block and checkpoint, their block hashes, the hash seed and the model identity to
        ``path`` (safetensors tensors + JSON metadata with checksums; no pickle, so loading cannot run code). The
        file is written next to ``path`` and renamed over it, so a crash never leaves a half-written file there.
        Waits for a running call in another thread.

        Raises:
            RuntimeError: called from inside a running ``generate()`` in this thread.
        """
        from .persistence import save_cache

        with self._shared.idle("save()"):
            save_cache(self, path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model: torch.nn.Module,
        *,
        max_cache_bytes: int | None = None,
        retention_interval: int | str | None = None,
        offload: str | None = None,
    ) -> HybridPrefixCache:
        """A new cache for ``model`` holding what :meth:`save` wrote to ``path`` (a warm start after a restart).

        Args:
            path: a file written by :meth:`save`.
            model: the same model (class, config, dtype and weights) under the same transformers and hf_hybridcache
                versions; its devices may differ.
            max_cache_bytes, retention_interval: None keeps the saved ones; a smaller budget keeps the most
                recently used entries that fit.
            offload: as in the constructor.

        Raises:
            ValueError: the file is not a cache file, is truncated or corrupted (checksums), or was saved for another
                model or version; nothing in memory changes.
        """
        from .persistence import load_cache

        return load_cache(cls, path, model, max_cache_bytes, retention_interval, offload)

    @property
    def is_compileable(self) -> bool:
        return False

    def __deepcopy__(self, memo):
        raise ValueError(
            "A HybridPrefixCache cannot be deep-copied (it holds the model and the stored prefixes). To reuse a "
            "prompt's cache across calls, pass the same HybridPrefixCache to every generate() call: each call "
            "restores the longest stored prefix by copy, and nothing a call does changes what is stored for others."
        )

    # ------------------------------------------------------------------ guards on the live layers

    def _check_owner(self) -> None:
        if self._request is None or not self._in_forward:
            raise ValueError(
                f"This HybridPrefixCache serves generate()/forward() calls of the model it was built for "
                f"({type(self.model).__name__} at {id(self.model):#x}), not of another model or of that model's "
                "backbone; build one HybridPrefixCache per model and pass it to that model."
            )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._check_owner()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states, layer_idx, *args, **kwargs):
        self._check_owner()
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    # ------------------------------------------------------------------ called by the patched mixers

    def checkpoint_positions(self, seq_len: int) -> tuple[int, ...]:
        """Token counts ``1 <= t < seq_len`` of the running forward after which a Mamba mixer must hand its state to
        :meth:`capture_states` (single-row forwards only). The state at the forward's end is read from the live
        layers instead."""
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

    # ------------------------------------------------------------------ batch reordering stops the row bookkeeping

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._stop_tracking("beam reordering")
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._stop_tracking("batch expansion")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._stop_tracking("batch selection")
        super().batch_select_indices(indices)

    # ------------------------------------------------------------------ speculative decoding: roll back rejected tokens

    def activate_past_recording(self) -> None:
        """Called by transformers before assisted / prompt-lookup decoding: from now on every forward of the request
        keeps the state after each of its tokens, so :meth:`crop` can roll rejected draft tokens back exactly (the
        per-token states of vLLM's Mamba speculative decoding)."""
        if self._awaiting_request:  # assisted decoding asks before its request begins
            self._rollback_next_request = True
        elif self._request is not None:
            self._request.rollback = True

    @property
    def is_croppable(self) -> bool:
        """True while the live request keeps the per-token states that :meth:`crop` rolls back to."""
        request = self._request
        return request is not None and request.rollback and len(request.rows) == 1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``abs(tokens_to_remove)`` tokens of the last forward: KV is cut, the Mamba state is set back
        to the copy taken after the kept tokens.

        Raises:
            ValueError: the tokens were not all fed by the last forward, or states were not kept
                (:meth:`activate_past_recording` was not called), or the batch has more than one row.
        """
        num_tokens = abs(tokens_to_remove)
        if num_tokens == 0:
            return
        request = self._request
        keep = None if request is None else request.forward_end - num_tokens
        states = None if keep is None or len(request.rows) != 1 else request.captured.get(keep)
        if states is None or not request.rollback:
            raise ValueError(
                "HybridPrefixCache can only roll back tokens fed by the last forward of a single-row request after "
                "activate_past_recording(); a Mamba state cannot be cut at an earlier token otherwise."
            )
        for attn in self.spec.attention:
            _compat.crop_kv(self.layers[attn.layer_idx], num_tokens)
        for layer_idx, (conv, ssm) in states.items():
            _compat.set_linear_state(self.layers[layer_idx], conv.clone(), ssm.clone())
        row = request.rows[0]
        del row.token_ids[keep:]
        full_blocks = keep // self.block_size
        self._store.release(row.block_ids[full_blocks:])
        del row.block_ids[full_blocks:], row.block_hashes[full_blocks:]
        request.forward_end = keep
        request.captured.clear()

    def _stop_tracking(self, why: str) -> None:
        if self._request is not None and self._request.tracking:
            logger.debug("%s: the rest of this request is not stored", why)
            self._request.tracking = False

    # ------------------------------------------------------------------ request life cycle

    def _check_request(self, input_ids: torch.Tensor | None) -> None:
        """Refuse, before anything changes, a request that cannot run: the model changed dtype or devices since the
        cache was built, an empty prompt, token ids outside the vocabulary.

        Raises:
            ValueError: with what to do.
        """
        shared = self._shared
        if self.model.dtype != shared.dtype:
            raise ValueError(
                f"The model is {self.model.dtype} but this HybridPrefixCache was built for it in {shared.dtype}, and "
                f"its stored entries are {shared.dtype}; convert the model back or build a new HybridPrefixCache."
            )
        devices = layer_devices(self.model, shared.devices)
        if devices != shared.devices:
            was = shared.devices
            moved = {idx: f"{was[idx]} -> {now}" for idx, now in devices.items() if now != was[idx]}
            raise ValueError(
                f"The model's layers moved to other devices since this HybridPrefixCache was built (layer: was -> now "
                f"{moved}); move them back or build a new HybridPrefixCache after placing the model."
            )
        if input_ids is None:
            return
        if input_ids.shape[-1] == 0:
            raise ValueError(
                "The prompt is empty: pass at least one token id (e.g. the BOS token); a prefix cache has nothing to "
                "look up and the model nothing to continue."
            )
        vocab_size = self.model.get_input_embeddings().num_embeddings
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"Token id {low if low < 0 else high} is outside the model's vocabulary [0, {vocab_size}); check "
                "that the tokenizer belongs to this model."
            )

    def _begin_request(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        num_rows: int,
        prompt_tokens: int = 0,
        pad_token_id: int | None = None,
    ) -> None:
        """Start a request: fresh live layers, then per row the lookup and restore of its longest hit.

        Rows are left-padded to a common length; a row's restored prefix and replay are run alone (padding between a
        restored state and its tail would make the SSM state decay), then the rows are assembled in the padded layout
        with all but each row's last token consumed, so ``generate()``'s own prefill runs one batched step.
        """
        self._end_active_request()
        self.layers = _compat.new_live_layers(self.model.config)
        rows_tokens = _unpadded_rows(input_ids, attention_mask)
        if rows_tokens is None:
            prompt_tokens = (
                [prompt_tokens] * num_rows if input_ids is None else attention_mask_lengths(input_ids, attention_mask)
            )
            # Nothing is looked up or stored, but a single row still keeps the states speculative decoding needs.
            single = input_ids is not None and num_rows == 1
            request = Request(rows=[Row(prompt_tokens=input_ids.shape[1], storing=False)] if single else [],
                              tracking=single)
            logger.debug(
                "no prefix reuse for this call (%s); it runs like a fresh cache",
                "inputs_embeds without input_ids" if input_ids is None else "padding other than left padding",
            )
        elif num_rows == 1 and len(rows_tokens[0]) == input_ids.shape[1]:
            request = Request(rows=[self._restore_row(rows_tokens[0])], tracking=True)
            request.forward_end = request.rows[0].hit_tokens
            prompt_tokens = [len(rows_tokens[0])]
        else:
            request = self._prefill_rows(rows_tokens, input_ids)
            prompt_tokens = [len(t) for t in rows_tokens]
        request.rollback, self._rollback_next_request, self._awaiting_request = self._rollback_next_request, False, False
        request.pad_token_id = pad_token_id
        self._request = request
        self._shared.active = self
        self.last_hit_tokens = [row.hit_tokens for row in request.rows] or [0] * num_rows
        c = self._counters
        c["requests"] += 1
        c["prompt_tokens"] += sum(prompt_tokens)
        c["hit_tokens"] += sum(self.last_hit_tokens)
        self._evicted_before_request = (self._store.evicted_kv_blocks, self._store.evicted_checkpoints)
        logger.debug(
            "request %d: prompt tokens %s, hit %s, replay %d, divergence at %s",
            c["requests"],
            prompt_tokens,
            self.last_hit_tokens,
            sum(prompt_tokens) - sum(self.last_hit_tokens),
            [row.divergence_tokens for row in request.rows],
        )

    def _end_request(self) -> None:
        """Release the live request's chains; the last checkpoint each row reached stays as its decode-end one."""
        request, self._request = self._request, None
        self._in_forward = False
        if self._shared.active is self:
            self._shared.active = None
        if request is not None:
            for row in request.rows:
                self._store.release(row.block_ids)
            kv_blocks, checkpoints = self._evicted_before_request
            logger.debug(
                "request %d ended: it evicted %d KV blocks and %d checkpoints; stored %d bytes of KV and %d of "
                "checkpoints",
                self._counters["requests"],
                self._store.evicted_kv_blocks - kv_blocks,
                self._store.evicted_checkpoints - checkpoints,
                self._store.kv.num_bytes,
                self._store.checkpoints.num_bytes,
            )

    def _end_active_request(self) -> None:
        """End the live request of whichever view of the store has one. A request stays live after ``generate()``
        returns (a direct forward may continue it); only one per store, so views made per call pin nothing for
        long."""
        active = self._shared.active
        if active is not None:
            active._end_request()

    def _live_is_empty(self) -> bool:
        return all(_compat.get_kv(self.layers[a.layer_idx]) is None for a in self.spec.attention) and all(
            _compat.get_linear_state(self.layers[m.layer_idx]) is None for m in self.spec.mamba
        )

    def _restore_row(self, token_ids: list[int]) -> Row:
        """Copy the longest stored prefix of ``token_ids`` into the (fresh, single-row) live layers."""
        hit = self._store.lookup(token_ids, self._root)
        row = Row(len(token_ids), token_ids=token_ids[: hit.hit_tokens], hit_tokens=hit.hit_tokens, root=self._root)
        if self.options.admit_divergence:
            row.divergence_tokens = hit.divergence_tokens
        if not hit.hit_tokens:
            return row
        for attn in self.spec.attention:
            keys, values = self._store.gather_kv(attn.layer_idx, hit.block_ids)
            _compat.set_kv(self.layers[attn.layer_idx], keys, values)
        for layer_idx, (conv, ssm) in self._store.checkpoint_copy(hit.block_ids[-1]).items():
            _compat.set_linear_state(self.layers[layer_idx], conv, ssm)
        self._store.pin(hit.block_ids)
        row.block_ids, row.block_hashes = list(hit.block_ids), list(hit.block_hashes)
        return row

    def _prefill_rows(self, rows_tokens: list[list[int]], input_ids: torch.Tensor) -> Request:
        """Restore and replay each row alone up to its last token, then assemble the batch's live layers."""
        rows: list[Row] = []
        try:
            return self._replay_rows(rows_tokens, input_ids, rows)
        except BaseException:
            for row in rows:  # the rows replayed so far hold pins; the failing row's request was ended by the hook
                self._store.release(row.block_ids)
            raise

    def _replay_rows(self, rows_tokens: list[list[int]], input_ids: torch.Tensor, rows: list[Row]) -> Request:
        """Restore and replay each row alone up to its last token (appending to ``rows``), then assemble them."""
        row_layers: list[list] = []
        for tokens in rows_tokens:
            twin = next((i for i, other in enumerate(rows_tokens[: len(rows)]) if other == tokens), None)
            if twin is not None:  # beams and num_return_sequences repeat rows: replay once, share the chain
                row = Row(**{**vars(rows[twin]), "token_ids": list(rows[twin].token_ids),
                             "block_ids": list(rows[twin].block_ids), "block_hashes": list(rows[twin].block_hashes)})
                self._store.pin(row.block_ids)
                rows.append(row)
                row_layers.append(row_layers[twin])
                continue
            self.layers = _compat.new_live_layers(self.model.config)
            row = self._restore_row(tokens)
            self._request = Request(rows=[row], tracking=True, forward_end=row.hit_tokens)
            tail = tokens[row.hit_tokens : len(tokens) - 1]
            if tail:
                _compat.run_forward(self.model, torch.tensor([tail], device=input_ids.device), self)
            self._request = None
            rows.append(row)
            row_layers.append(self.layers)
        consumed = input_ids.shape[1] - 1
        for row in rows:
            row.pad = consumed - len(row.token_ids)
        self.layers = _compat.new_live_layers(self.model.config)
        if consumed:
            self._assemble_rows(row_layers, [row.pad for row in rows])
        return Request(rows=rows, tracking=True, forward_start=consumed, forward_end=consumed)

    def _assemble_rows(self, row_layers: list[list], pads: list[int]) -> None:
        """Fill the fresh live layers with the rows' layers, each KV left-padded by ``pads[r]`` zero positions
        (masked out by the attention mask) and a missing state (a row that consumed nothing) as zeros."""
        devices = self._shared.devices
        for attn in self.spec.attention:
            device = devices[attn.layer_idx]
            keys, values = [], []
            for layers, pad in zip(row_layers, pads):
                kv = _compat.get_kv(layers[attn.layer_idx])
                if kv is None:
                    kv = (torch.zeros(1, attn.num_kv_heads, 0, attn.head_dim, dtype=attn.dtype, device=device),) * 2
                keys.append(torch.nn.functional.pad(kv[0], (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(kv[1], (0, 0, pad, 0)))
            _compat.set_kv(self.layers[attn.layer_idx], torch.cat(keys), torch.cat(values))
        for m in self.spec.mamba:
            device = devices[m.layer_idx]
            convs, ssms = [], []
            for layers in row_layers:
                state = _compat.get_linear_state(layers[m.layer_idx])
                if state is None:
                    state = (torch.zeros(1, *m.conv.shape, dtype=m.conv.dtype, device=device),
                             torch.zeros(1, *m.ssm.shape, dtype=m.ssm.dtype, device=device))
                convs.append(state[0])
                ssms.append(state[1])
            _compat.set_linear_state(self.layers[m.layer_idx], torch.cat(convs), torch.cat(ssms))

    # ------------------------------------------------------------------ around every forward

    def _before_forward(self, input_ids: torch.Tensor | None, num_rows: int, num_tokens: int) -> None:
        if self._request is None:  # a forward outside generate(): one request that starts with this forward
            self._end_active_request()
            # Live layers that hold tokens nobody tracked (a failed or ended request) must not be stored as if they
            # held this forward's prefix.
            tracking = num_rows == 1 and input_ids is not None and self._live_is_empty()
            self._request = Request(
                rows=[Row(prompt_tokens=num_tokens, root=self._root)] if tracking else [], tracking=tracking
            )
            self._shared.active = self
        request = self._request
        self._in_forward = True
        request.captured.clear()
        request.forward_start = request.forward_end
        request.forward_end += num_tokens
        request.emit_positions = ()
        if not request.tracking:
            return
        if input_ids is None or num_rows != len(request.rows):
            self._stop_tracking("a forward without input_ids or with another batch size")
            return
        for row, ids in zip(request.rows, input_ids.tolist()):
            if num_rows > 1 and num_tokens == 1 and ids[0] == request.pad_token_id:
                # generate() feeds the pad id to rows that already ended (EOS): stop the row where it really ended,
                # so its decode-end checkpoint and blocks are not replaced by padding.
                row.finished = True
            if not row.finished:
                row.token_ids.extend(ids)
        if num_rows == 1:  # the mixers emit interior states for single-row forwards
            row, start, end = request.rows[0], request.forward_start, request.forward_end
            bs = self.block_size
            retained = retained_boundaries(
                start, end, row.prompt_tokens, bs, self.options.retention_tokens, row.divergence_tokens
            )
            # Besides the retained boundaries the last boundary reached is wanted: it becomes the decode-end
            # checkpoint if the request stops before the next one.
            request.wanted = frozenset(retained) | {last_boundary(end, bs)}
            positions = {b - start for b in request.wanted if start < b < end}
            if request.rollback:  # draft tokens past the prompt may be rejected: keep every state after them
                positions.update(range(max(1, row.prompt_tokens - start), end - start))
            request.emit_positions = tuple(sorted(positions))

    def _abort_forward(self) -> None:
        """The forward raised: its live state is half-written, so nothing of it is stored and the request ends."""
        self._end_request()

    def _after_forward(self) -> None:
        request = self._request
        self._in_forward = False
        if request is None or not request.tracking:
            return
        bs = self.block_size
        num_tokens = request.forward_end - request.forward_start
        for index, row in enumerate(request.rows):
            if row.finished:
                continue
            store_row_blocks(self._store, row, lambda block: self._live_block_kv(index, row.pad, block))
            end = len(row.token_ids)
            captured = (
                {b: request.captured[b] for b in request.wanted if b in request.captured}
                if len(request.rows) == 1
                else {}
            )
            if end % bs == 0:
                captured[end] = self._live_row_states(index)
            if not captured:  # most decode steps
                continue
            start, divergence = end - num_tokens, row.divergence_tokens
            retained = retained_boundaries(start, end, row.prompt_tokens, bs, self.options.retention_tokens, divergence)
            # A divergence checkpoint counts only where nothing else (retention, prompt end) would have kept one.
            admitted = divergence in captured and divergence not in retained_boundaries(
                start, end, row.prompt_tokens, bs, self.options.retention_tokens
            )
            for boundary in sorted(captured):
                stored = store_row_checkpoint(self._store, row, boundary, captured[boundary], boundary not in retained)
                if stored and admitted and boundary == divergence:
                    self._counters["divergence_checkpoints"] += 1
        if not request.rollback:
            request.captured.clear()

    def _live_block_kv(self, row: int, pad: int, block: int) -> dict[int, torch.Tensor]:
        """Copies of a row's block ``block`` of live KV: ``{attention layer idx: [2, Hkv, block_size, D]}``."""
        start = pad + block * self.block_size
        kv = {}
        for attn in self.spec.attention:
            keys, values = _compat.get_kv(self.layers[attn.layer_idx])
            kv[attn.layer_idx] = scatter_kv_blocks(keys, values, [start], self.block_size, row)[0]
        return kv

    def _live_row_states(self, row: int) -> dict[int, LayerState]:
        """Copies of one row's live Mamba states: ``{mamba layer idx: (conv [1, C, W], ssm)}``."""
        states = {}
        for m in self.spec.mamba:
            conv, ssm = _compat.get_linear_state(self.layers[m.layer_idx])
            states[m.layer_idx] = (conv[row : row + 1].clone(), ssm[row : row + 1].clone())
        return states


def _unpadded_rows(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> list[list[int]] | None:
    """Each row's tokens without its left padding; None when there are no ids or the padding is not all on the
    left (then nothing can be reused exactly)."""
    if input_ids is None:
        return None
    rows = input_ids.tolist()
    if attention_mask is None:
        return rows
    attention_mask = attention_mask.bool()
    lengths = attention_mask.sum(dim=1).tolist()
    left_padded = all(
        bool(mask_row[len(row) - n :].all()) and not bool(mask_row[: len(row) - n].any())
        for mask_row, row, n in zip(attention_mask, rows, lengths)
    )
    if not left_padded or 0 in lengths:
        return None
    return [row[len(row) - n :] for row, n in zip(rows, lengths)]


def attention_mask_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    return attention_mask.bool().sum(dim=1).tolist()


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


def _on_request(model, input_ids, model_kwargs, generation_config) -> int:
    cache = _cache_for(model, model_kwargs)
    if cache is None:
        return 0
    embeds = model_kwargs.get("inputs_embeds")
    if model_kwargs.get("use_cache") is False:
        # Each step re-feeds the whole sequence and nothing is cached between steps: there is nothing to store.
        cache._begin_request(None, None, input_ids.shape[0], prompt_tokens=input_ids.shape[1])
        return 0
    cache._check_request(None if embeds is not None else input_ids)
    if embeds is not None:
        cache._begin_request(None, None, embeds.shape[0], prompt_tokens=embeds.shape[1])
    else:
        pad = generation_config._pad_token_tensor
        cache._begin_request(
            input_ids,
            model_kwargs.get("attention_mask"),
            input_ids.shape[0],
            pad_token_id=None if pad is None else int(pad.reshape(-1)[0]),
        )
    return cache.last_hit_tokens[0]


@contextlib.contextmanager
def _on_generate(model, kwargs):
    """Around one ``generate()`` call: hold the cache's lock; if the call raises, end its request (the live state is
    half-written and nothing more of it is stored)."""
    cache = _cache_for(model, kwargs)
    if cache is None:
        yield
        return
    with cache._shared.generate_scope():
        cache._awaiting_request = True
        failed = True
        try:
            with _compat.allow_speculative_decoding(model):
                yield
            failed = False
        finally:
            cache._awaiting_request = cache._rollback_next_request = False
            cache._slice_first_forward = 0
            if failed:
                cache._end_request()


def _on_forward_pre(model, args, kwargs) -> None:
    cache = _cache_for(model, kwargs)
    if cache is None:
        return
    cache._shared.enter_forward()
    if kwargs.get("use_cache") is False:
        cache._stop_tracking("a forward with use_cache=False")
    input_ids = _compat.forward_input_ids(args, kwargs)
    embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        cache._before_forward(input_ids, input_ids.shape[0], input_ids.shape[1])
    elif embeds is not None:
        cache._before_forward(None, embeds.shape[0], embeds.shape[1])


def _on_forward_post(model, args, kwargs, output) -> None:
    """Runs after every forward, also one that raised (torch then passes ``output=None``)."""
    cache = _compat.find_cache(kwargs)
    if not isinstance(cache, HybridPrefixCache) or cache.model is not model:
        return
    try:
        if output is None:
            cache._abort_forward()
        else:
            cache._after_forward()
    finally:
        cache._shared.exit_forward()
