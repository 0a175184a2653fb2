"""HybridPrefixCache: the transformers ``Cache`` users pass to every ``generate()`` call.

This module is the thin face: options, stats, salted views, save/load, what runs a request outside ``generate()``. The
life of a call is :mod:`~hf_hybridcache.generate`, what the cache and its views share :mod:`~hf_hybridcache.core`,
what is stored :mod:`~hf_hybridcache.store` (the path of one call: docs/design.md).
"""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import torch
from transformers.cache_utils import Cache

from . import _compat
from ._compat.hub_kernels import refuse_cache_kernels_from_hub
from .config import DEFAULT_MAX_CACHE_BYTES, CacheOptions
from .core import CacheCore, HitReport, WeightsTracker, load_cache, save_cache
from .generate import HOOKS, LiveCache, LiveState, explain_call, lifecycle, replays_by_default
from .hashing import hash_seed, model_identity
from .models import support_for
from .models.paths import check_mode, install_forward_paths
from .remote import RemoteTier, remote_config
from .remote import attach as attach_remote
from .stats import PrefixCacheStats
from .store import FlopModel, Placement, PrefixStore, layer_devices, make_eviction

__all__ = ["HybridPrefixCache", "PrefixCacheStats"]


class HybridPrefixCache(LiveCache):
    """Cross-request prefix cache for hybrid attention + Mamba models; pass it to every ``generate()`` call.

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
        admit_divergence: keep a checkpoint where a prompt leaves an already stored token path, taken inside the
            same prefill, so the shared prefix is reusable from the next request on (Marconi's admission rule).
        remote: a shared second tier (Redis or Valkey; :mod:`hf_hybridcache.remote`): a ``redis://`` or ``rediss://``
            URL, a redis-py client or a :class:`~hf_hybridcache.remote.RemoteConfig`: entries are published there, a
            short local hit fetches the longer chain other processes stored, and unless ``seed`` is given the hash seed
            is the tier's for this model, so processes share (docs/shared-tier.md). None: no tier.
        eviction: ``"flop_aware"`` (evict the lowest recency + alpha x prefill FLOPs saved per byte, after Marconi)
            or ``"lru"`` (least recently used first). Either way a KV block goes only after the blocks that extend it
            and after its own checkpoint, and the running request's blocks never go.
        replay_replies: store replies from one prefill of their tokens when ``generate()`` has its output, and leave
            two tokens to a hit's tail (:mod:`hf_hybridcache.generate.reply_replay`); None: on in bf16/fp16, see there.
        deterministic: a request's tokens and logprobs are the same bits whatever was restored or shared its batch,
            in ``generate()`` and the engine (docs/deterministic.md); Mamba, Falcon-Mamba and Mamba-2 on CPU, others
            refused.

    Attributes:
        core: the :class:`~hf_hybridcache.core.CacheCore` this cache and its views share: the interface for code
            that serves requests beside ``generate()`` (a serving engine); not needed to use the cache.
        live: this view's :class:`~hf_hybridcache.generate.live_cache.LiveState` (its live request).
        last_reports: why each row of this view's latest request hit what it hit (``last_report``: the first row's).

    Raises:
        ValueError: unsupported model (or transformers version, or Hub kernels handed the cache: load with
            ``use_kernels=False``); invalid ``block_size``, ``retention_interval``, ``max_cache_bytes``, ``seed``,
            ``offload``, ``admit_divergence``, ``eviction``, ``replay_replies`` or ``remote``; a budget smaller than
            one KV block plus one checkpoint; a ``block_size`` longer than a sliding attention window of the model;
            ``deterministic`` where it cannot hold (named) or unlike the mode the model already serves.
        TypeError: ``remote`` is not a URL, a redis-py client or a ``RemoteConfig``.
        ImportError: ``remote`` is a URL and redis-py is not installed (``pip install redis``).
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
        remote=None,
        replay_replies: bool | None = None,
        deterministic: bool = False,
    ) -> None:
        _compat.check_version()
        support = support_for(model)
        refuse_cache_kernels_from_hub(model)
        seed_given, seed = seed is not None, hash_seed(seed)  # validated (or drawn) before anything is patched
        remote = remote_config(remote)
        budget = DEFAULT_MAX_CACHE_BYTES if max_cache_bytes is None else max_cache_bytes
        replay = False if replay_replies is None else replay_replies  # None: decided from the model below
        options = CacheOptions(block_size, retention_interval, budget, admit_divergence, eviction, replay)
        self.spec = support.spec_for(model, block_size)
        self.spec.check_budget(options.max_cache_bytes)
        check_mode(model, self.spec, deterministic)  # before anything is patched
        if replay_replies is None:
            options = replace(options, replay_replies=replays_by_default(model.dtype, self.spec))
        devices = layer_devices(model, [layer.layer_idx for layer in (*self.spec.attention, *self.spec.mamba)])
        placement = Placement(devices, offload)
        self.model = model
        support.install(model)
        install_forward_paths(model, support, devices.values(), deterministic)
        _compat.install_hooks(model, HOOKS)
        super().__init__(layers=_compat.new_live_layers(model.config))
        policy = make_eviction(options.eviction, FlopModel.from_model(model, self.spec))
        self.core = CacheCore(self.spec, options, seed, model_identity(model, deterministic), WeightsTracker(model), model.dtype,
                              devices, placement, policy)
        self.core.remote = attach_remote(self, remote, seed_given)
        self._start_view(None)
        _compat.install_manager_hook(model, self, _manager_for)

    def _start_view(self, salt: str | None) -> None:
        """Give this object its own (empty) live state for requests under ``salt``."""
        self.salt = salt
        self.live = LiveState(self.core.root(salt))
        self.last_hit_tokens: list[int] = []
        self.last_reports: list[HitReport] = []

    # ------------------------------------------------------------------ public API

    @property
    def options(self) -> CacheOptions:
        return self.core.options

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def max_cache_bytes(self) -> int:
        return self.options.max_cache_bytes

    @max_cache_bytes.setter
    def max_cache_bytes(self, max_cache_bytes: int | None) -> None:
        """Change the budget (None: the default); when it shrinks, the entries the eviction policy ranks lowest are
        evicted at once. Waits for a running call in another thread.

        Raises:
            ValueError: not None or a positive int, or smaller than one KV block plus one checkpoint, or smaller than
                the prefixes a serving engine's running requests keep pinned.
            RuntimeError: called from inside a running ``generate()`` or engine step in this thread.
        """
        value = DEFAULT_MAX_CACHE_BYTES if max_cache_bytes is None else max_cache_bytes
        options = replace(self.options, max_cache_bytes=value)
        self.spec.check_budget(value)
        with self.core.idle("Changing max_cache_bytes"):
            lifecycle.end_live_requests(self)  # unpins the last requests' chains, so everything above the budget can go
            self.core.set_options(options)

    @property
    def store(self) -> PrefixStore:
        """The store this cache and its views share (read it between calls: health checks, export, inspection)."""
        return self.core.store

    @property
    def remote(self) -> RemoteTier | None:
        """The shared second tier (``remote=``), or None; ``cache.remote.flush()`` waits for queued writes."""
        return self.core.remote

    @property
    def root_hash(self) -> bytes:
        """Parent hash of block 0 for this view's requests: seed, model identity, weights state and salt mixed."""
        return self.live.root

    @property
    def seed(self) -> bytes:
        """The bytes mixed into every block hash (kept by :meth:`save`)."""
        return self.core.seed

    @property
    def layer_devices(self) -> dict[int, torch.device]:
        """``{cache layer idx: device}`` the model's layers computed on when the cache was built."""
        return dict(self.core.devices)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the stored KV blocks and checkpoints (never above ``max_cache_bytes``)."""
        return self.core.store.stored_bytes

    @property
    def stats(self) -> PrefixCacheStats:
        """Counters of this cache and all its :meth:`with_salt` views (they share one store)."""
        return self.core.stats()

    @property
    def last_report(self) -> HitReport | None:
        """Why the first row of this view's latest request hit what it hit; None before its first request."""
        return self.last_reports[0] if self.last_reports else None

    def explain(self, input_ids, salt: str | None = None, remote: bool = False, attention_mask=None):
        """What a ``generate()`` of ``input_ids`` would restore and why, changing nothing; see
        :func:`~hf_hybridcache.generate.dry_run.explain_call` (arguments, what comes back, errors)."""
        return explain_call(self, input_ids, self.salt if salt is None else salt, remote, attention_mask)

    def reset(self) -> None:
        """End the live request and empty the live layers; stored blocks and checkpoints stay. Waits for a running
        call on this view in another thread.

        Raises:
            RuntimeError: called from inside a running ``generate()`` in this thread (it would empty that call's live
                layers).
        """
        with self.core.view_idle(self, "reset()"):
            lifecycle.end_request(self)
            self.layers = _compat.new_live_layers(self.model.config)

    def clear(self) -> None:
        """Drop every stored KV block and checkpoint (for all :meth:`with_salt` views) and the live request, and read
        every weight again (:mod:`~hf_hybridcache.core.weights`: after a write through ``param.data``, which requests
        do not always see, requests root in the new weights). Counters of past requests stay. Waits for a running call
        in another thread.

        Raises:
            RuntimeError: called from inside a running ``generate()`` or engine step in this thread.
        """
        with self.core.idle("clear()"):
            lifecycle.end_live_requests(self)
            self.layers = _compat.new_live_layers(self.model.config)
            self.core.clear_store()
            self.core.weights.refresh(full=True)

    def with_salt(self, salt: str | None) -> HybridPrefixCache:
        """A view of this cache for one tenant: requests made with it only reuse prefixes stored by requests with the
        same salt (vLLM's ``cache_salt``), because the salt is mixed into the root of every block hash chain. The view
        shares the store, the budget, the counters and the lock with this cache, and has its own live state: it is
        cheap to make one per call (``generate(ids, cache=cache.with_salt(user_id))``).

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

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, *, limits=None,
                                 speculation=None):
        """A continuous-batching manager serving many requests at once with this cache's store, shared with
        ``generate()`` calls: :class:`~hf_hybridcache.engine.ContinuousBatchingManager` (transformers' API). Requests
        without a ``cache_salt`` use this view's salt. The model's ``init_continuous_batching``, ``generate_batch``
        and ``continuous_batching_context_manager`` use it too.

        Args:
            generation_config: transformers' ``GenerationConfig`` (the model's when None).
            continuous_batching_config: transformers' ``ContinuousBatchingConfig`` (see the manager).
            limits: :class:`~hf_hybridcache.engine.EngineLimits` (from the device's memory when None).
            speculation: :class:`~hf_hybridcache.engine.Speculation` of speculative steps (none when None).

        Raises:
            ValueError: the model's attention implementation is not ``sdpa`` or ``eager``.
        """
        from .engine import ContinuousBatchingManager

        return ContinuousBatchingManager(self, generation_config, continuous_batching_config, limits=limits,
                                         salt=self.salt, speculation=speculation)

    def save(self, path: str | os.PathLike) -> None:
        """Write every stored KV block and checkpoint, their block hashes, the hash seed and the model identity to
        ``path`` (safetensors + JSON with checksums, no pickle; written next to ``path`` and renamed over it: see
        docs/usage.md). Waits for a running call in another thread.

        Raises:
            ValueError: ``path`` is a directory or its folder does not exist; nothing is written.
            OSError: the file cannot be written (naming ``path`` and the cause); nothing is written, the cache is kept.
            RuntimeError: called from inside a running ``generate()`` or engine step in this thread.
        """
        with self.core.idle("save()"):
            save_cache(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module, *, max_cache_bytes: int | None = None,
             retention_interval: int | str | None = None, offload: str | None = None, remote=None,
             deterministic: bool | None = None) -> HybridPrefixCache:
        """A new cache for ``model`` holding what :meth:`save` wrote to ``path`` (a warm start after a restart).

        Args:
            path: a file written by :meth:`save`.
            model: the same model (class, config, dtype and weights) under the same transformers and hf_hybridcache
                versions; its devices may differ.
            max_cache_bytes: None keeps the saved budget; a smaller one keeps the most recently used entries that
                fit.
            retention_interval: None keeps the saved one.
            offload: as in the constructor.
            remote: as in the constructor; the loaded entries are queued for the tier (``cache.remote.flush()``
                waits for them). The file's hash seed is kept: they are shared with other caches only when it was
                saved by a cache with ``remote=`` (the tier's namespace seed) or the same ``seed=``.
            deterministic: None keeps the saved mode; True or False must equal it.

        Raises:
            ValueError: the file is not a cache file, is truncated or corrupted (checksums), or was saved for another
                model or version or in the other mode (whose states its arithmetic did not compute); nothing changes.
        """
        return load_cache(cls, path, model, max_cache_bytes, retention_interval, offload, remote, deterministic)

    def __repr__(self) -> str:
        o = self.options
        return (
            f"HybridPrefixCache({type(self.model).__name__}, block_size={o.block_size}, retention_interval="
            f"{o.retention_interval!r}, eviction={o.eviction!r}, admit_divergence={o.admit_divergence}, salt="
            f"{self.salt!r}, stored_bytes={self.stored_bytes}, max_cache_bytes={o.max_cache_bytes})"
        )

    def restore(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[int]:
        """Start a request outside ``generate()`` (which does this by itself): restore each row of ``input_ids``
        ``[B, T]`` int64 (left-padded rows with ``attention_mask`` ``[B, T]``) from its longest stored prefix, for a
        decoding loop of your own, which feeds ``input_ids[:, cache.get_seq_length():]`` next (docs/limits.md: the
        loop, batches, threads). Returns the restored tokens per row.

        Raises:
            ValueError: ``input_ids`` not ``[B, T]``, an empty prompt, ids outside the vocabulary, or a model that
                changed dtype or devices.
            RuntimeError: called from inside a running ``generate()`` in this thread.
        """
        with self.core.view_idle(self, "restore()"), self.core.calls.call():
            lifecycle.check_request(self, input_ids)
            lifecycle.start_request(self, input_ids, attention_mask, input_ids.shape[0])
            return list(self.last_hit_tokens)


def _manager_for(cache: HybridPrefixCache, generation_config, continuous_batching_config):
    """``model.init_continuous_batching``'s manager (see :meth:`HybridPrefixCache.init_continuous_batching`)."""
    return cache.init_continuous_batching(generation_config, continuous_batching_config)

