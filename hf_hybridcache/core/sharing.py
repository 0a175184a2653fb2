"""What a :class:`~hf_hybridcache.HybridPrefixCache`, its salted views and any other caller of the store share
(:class:`CacheCore`): one store, its lock, the weights state, the tier and the counters. How calls from several
threads share it (the store lock, each view's call lock, the call gate) is :mod:`~hf_hybridcache.core.calls`.

A request, whoever runs it, goes through it in this order:

1. ``root, generation = core.request_start(salt)``: re-read the weights state; the root of the request's
   chains and the weights generation its rows record.
2. Holding ``store_lock``: ``hit = core.lookup(token_ids, root)`` (the longest restorable prefix, extended from
   the tier first) and ``core.report(token_ids, root, hit)`` (why it is that long,
   :class:`~hf_hybridcache.core.explain.HitReport`); copy or share the hit into the request's own state
   (``core.store.gather_kv`` or the pages of ``core.store.page_table(hit.block_ids)``,
   ``core.store.checkpoint_copy``; a stored entry is never written), then ``core.pin(hit.block_ids)`` so that
   nothing evicts the chain under the request.
3. ``core.count_request(prompt_tokens, hit_tokens, reasons)`` (the reports' reasons, one per row).
4. As the request computes: ``core.check_weights(rows)`` once per forward that stores, then
   ``core.store_blocks(row, ...)`` or ``core.store_pages(row, ...)`` and ``core.store_checkpoint(row, ...)``.
5. At its end ``core.release(row.block_ids)``: the restored chain and the blocks it stored (pinned).

Every method that reads or changes the store takes ``store_lock`` itself; hold it around a sequence that must
see one state of the store (step 2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .. import _compat
from ..config import CacheOptions, ModelStateSpec, StateKey
from ..hashing import BlockHash
from ..kernels.paged_copy import KVBlock
from ..stats import PrefixCacheStats
from ..store import EvictionPolicy, Hit, LayerState, Placement, PrefixStore, layer_devices
from . import explain
from .calls import CallGate, CallScopes
from .history import Eviction, EvictionLog, WeightsHistory
from .roots import WeightsRoots
from .rows import Row, store_row_blocks, store_row_checkpoint
from .weights import WeightsTracker

if TYPE_CHECKING:
    from ..remote import RemoteTier
    from ..remote.fetch import TierReach


class CacheCore(CallScopes, WeightsRoots):
    """What a cache, its :meth:`~hf_hybridcache.HybridPrefixCache.with_salt` views and any other caller of the store
    (a serving engine) share: one store under one budget, the roots of the block hash chains (seed, model identity,
    weights state, salt: :class:`~hf_hybridcache.core.roots.WeightsRoots`), the remote tier, the counters and the
    locks. Nothing else reaches these. A request goes through it in the order the module docstring gives.

    Args:
        spec: the model's layers and per-entry byte sizes.
        options: the validated :class:`~hf_hybridcache.config.CacheOptions`.
        seed: bytes mixed into every root hash (saved with the cache so stored hashes stay valid).
        identity: the model identity mixed into every root hash.
        weights: the model's weights state, re-read at every request; its fingerprint is mixed into every root hash.
        dtype, devices: the model's dtype and each cache layer's device when the cache was built; stored entries
            are only valid while the model keeps them.
        placement, eviction: where stored tensors live and the eviction policy of the store.

    Attributes:
        store: the :class:`~hf_hybridcache.store.PrefixStore`.
        remote: the :class:`~hf_hybridcache.remote.RemoteTier`, or None without ``remote=``.
        counters: ``{"requests", "prompt_tokens", "hit_tokens", "divergence_checkpoints", "replayed_reply_tokens":
            int}`` of past requests.
        reasons: ``{reason: rows}``, the :data:`~hf_hybridcache.core.explain.REASONS` of past requests' rows.
        evictions: the entries the budget evicted lately (:class:`~hf_hybridcache.core.history.EvictionLog`).
        weights_history: the weights states before the current one and the salts of roots in use.
        store_lock: held by every operation on the store and the counters (see the module docstring).
        calls: the :class:`CallGate` of ``generate()`` calls and store-wide operations.
        live_views: ``{id(view): view}`` of the views whose request is live (its chains are pinned).
        generating_threads, engine_threads: the threads inside a ``generate()`` call with this core
            (:meth:`generate_scope`), and inside a step of a serving engine on it (:meth:`engine_scope`).
        epoch: how many times the store was emptied (:meth:`clear_store`); a caller that keeps rows across calls
            (a serving engine) drops their chains when it changes.
        pinning: callables returning the block ids other callers (serving engines) keep pinned, for the checks.
        warned_masked_prompt: the warning that a prompt's mask ruled out reuse was given (it is given once).
    """

    def __init__(
        self,
        spec: ModelStateSpec,
        options: CacheOptions,
        seed: bytes,
        identity: str,
        weights: WeightsTracker,
        dtype: torch.dtype,
        devices: dict[int, torch.device],
        placement: Placement,
        eviction: EvictionPolicy,
    ) -> None:
        self.options = options
        self.seed, self.identity, self.weights = seed, identity, weights
        self.dtype, self.devices = dtype, devices
        self.store = PrefixStore(spec, self.root(None), options.max_cache_bytes, placement, eviction)
        self.remote: RemoteTier | None = None
        self.counters = dict(
            requests=0, prompt_tokens=0, hit_tokens=0, divergence_checkpoints=0, replayed_reply_tokens=0
        )
        self.reasons = dict.fromkeys(explain.REASONS, 0)
        self.evictions = EvictionLog()
        self.weights_history = WeightsHistory()
        self._budget_lowered = False
        self.store.on_removed = self._on_removed
        self.store_lock = threading.RLock()
        self.calls = CallGate()
        self.live_views: dict[int, object] = {}
        self.generating_threads, self.engine_threads = set(), set()
        self.epoch = 0
        self.pinning: list[Callable[[], set[int]]] = []
        self.warned_masked_prompt = False
        self._warned_generation = -1

    # ------------------------------------------------------------------ the model

    def check_model(self, model: torch.nn.Module) -> str | None:
        """Refuse a request when ``model`` changed dtype or devices since the cache was built (stored entries would
        not fit it). Returns why its forwards may not restore or store now (a key of
        :data:`~hf_hybridcache.core.explain.NOT_CACHEABLE`: training mode with dropout on, ...;
        :func:`~hf_hybridcache._compat.uncached_cause`), or None.

        Raises:
            ValueError: with what to do.
        """
        if model.dtype != self.dtype:
            raise ValueError(
                f"The model is {model.dtype} but this HybridPrefixCache was built for it in {self.dtype}, and its "
                f"stored entries are {self.dtype}; convert the model back or build a new HybridPrefixCache."
            )
        devices = layer_devices(model, self.devices)
        if devices != self.devices:
            moved = {idx: f"{self.devices[idx]} -> {now}" for idx, now in devices.items() if now != self.devices[idx]}
            raise ValueError(
                f"The model's layers moved to other devices since this HybridPrefixCache was built (layer: was -> now "
                f"{moved}); move them back or build a new HybridPrefixCache after placing the model."
            )
        return _compat.uncached_cause(model)

    # ------------------------------------------------------------------ the store

    def lookup(self, token_ids: list[int], root: BlockHash, tail_tokens: int | None = None) -> Hit:
        """The longest restorable prefix of ``token_ids`` under ``root`` that leaves at least ``tail_tokens`` tokens
        to run (None: the options' ``min_tail_tokens``; :meth:`PrefixStore.lookup
        <hf_hybridcache.store.PrefixStore.lookup>`). With a remote tier, what it holds beyond the local hit is
        inserted into the store first (:mod:`~hf_hybridcache.remote.fetch`), and a path it holds that the prompt
        leaves counts as a divergence point. ``divergence_tokens`` is 0 unless ``admit_divergence`` is on. Hold
        ``store_lock`` until the hit is pinned."""
        with self.store_lock:
            reach = None if self.remote is None else self.remote.extend(token_ids, root)
            return self._with_tier(self.store.lookup(token_ids, root, self._tail(tail_tokens)), reach)

    def peek(
        self, token_ids: list[int], root: BlockHash, remote: bool = False, find: Callable[..., Hit] | None = None
    ) -> Hit:
        """What :meth:`lookup` would return, changing nothing (no recency, no counters, nothing fetched or stored).
        ``remote``: ask the tier too, with one ``EXISTS`` pipeline that leaves no trace
        (:meth:`~hf_hybridcache.remote.RemoteTier.probe`); a hit the tier would supply has no block ids. ``find``:
        the local search, ``(token_ids, root) -> Hit`` (:meth:`PrefixStore.find
        <hf_hybridcache.store.PrefixStore.find>` when None; a dry run of a batch adds what earlier rows store)."""
        with self.store_lock:
            hit = (self.store.find if find is None else find)(token_ids, root, self._tail(None))
        if not remote or self.remote is None:
            return self._with_tier(hit, None)
        reach = self.remote.probe(token_ids, root)
        if reach.fetch and reach.checkpoint_tokens > hit.hit_tokens:
            hit = replace(hit, hit_tokens=reach.checkpoint_tokens, block_ids=(), block_hashes=(),
                          divergence_tokens=hit.divergence_tokens if hit.divergence_tokens > reach.checkpoint_tokens
                          else 0)
        return self._with_tier(hit, reach)

    def _with_tier(self, hit: Hit, reach: TierReach | None) -> Hit:
        """``hit`` with what the tier held past it and the divergence point admission acts on."""
        if reach is not None:
            left = reach.checkpoint_tokens if not reach.fetch and reach.checkpoint_tokens > hit.hit_tokens else 0
            hit = replace(hit, tier_kv_tokens=reach.kv_tokens, tier_checkpoint_tokens=left)
        if not self.options.admit_divergence:
            return replace(hit, divergence_tokens=0) if hit.divergence_tokens else hit
        remote_divergence = 0 if reach is None or reach.divergence_tokens <= hit.hit_tokens else reach.divergence_tokens
        return replace(hit, divergence_tokens=hit.divergence_tokens or remote_divergence)

    def _tail(self, tail_tokens: int | None) -> int:
        return self.options.min_tail_tokens if tail_tokens is None else tail_tokens

    def report(self, token_ids: list[int], root: BlockHash, hit: Hit, uncached: str | None = None
               ) -> explain.HitReport:
        """Why the hit of ``token_ids`` under ``root`` is ``hit`` (what :meth:`lookup` or :meth:`peek` returned, before
        anything else changes the store): :func:`~hf_hybridcache.core.explain.make_report`; ``uncached``: a cause
        (a key of :data:`~hf_hybridcache.core.explain.NOT_CACHEABLE`) for which nothing was looked up."""
        if uncached is not None:
            return explain.not_cacheable(len(token_ids), uncached)
        return explain.make_report(self, token_ids, root, hit)

    def pin(self, block_ids) -> None:
        """Keep a request's chain ``block_ids`` from eviction until :meth:`release` (pins count per request)."""
        with self.store_lock:
            self.store.pin(block_ids)

    def release(self, block_ids: list[int]) -> None:
        """Unpin a chain :meth:`pin` pinned or :meth:`store_blocks` grew."""
        with self.store_lock:
            self.store.release(block_ids)

    def store_blocks(self, row: Row, live_block_kv: Callable[[int], dict[int, KVBlock]]) -> None:
        """Store every full block of ``row`` not stored yet, pinned for the request
        (:func:`~hf_hybridcache.core.rows.store_row_blocks`); ``live_block_kv(index)`` copies block ``index``."""
        with self.store_lock:
            store_row_blocks(self.store, row, live_block_kv)

    def store_pages(self, row: Row, page_of_block: Callable[[int], int]) -> None:
        """Store every full block of ``row`` not stored yet by reference to the page that holds it
        (``page_of_block(index)``, a page of ``store.pages`` the caller filled and holds), pinned for the request."""
        with self.store_lock:
            store_row_blocks(self.store, row, page_of_block=page_of_block)

    def store_checkpoint(self, row: Row, boundary: int, states: dict[StateKey, LayerState], tentative: bool) -> bool:
        """Store ``row``'s state after ``boundary`` tokens (:func:`~hf_hybridcache.core.rows.store_row_checkpoint`);
        True if a new checkpoint was stored."""
        with self.store_lock:
            return store_row_checkpoint(self.store, row, boundary, states, tentative)

    def set_options(self, options: CacheOptions) -> None:
        """Apply ``options`` whose ``max_cache_bytes`` (the only option that changes after construction) may differ:
        what no longer fits the budget is evicted. The caller holds :meth:`idle`.

        Raises:
            ValueError: the chains running requests of a serving engine pin do not fit the new budget (the budget
                is left as it was).
        """
        with self.store_lock:
            previous = self.store.max_cache_bytes
            self.store.max_cache_bytes = options.max_cache_bytes
            self._budget_lowered = True  # evictions now are the budget's change, not a request's
            try:
                fits = self.store.make_room(0)
            finally:
                self._budget_lowered = False
            if not fits:
                self.store.max_cache_bytes = previous
                raise ValueError(
                    f"`max_cache_bytes={options.max_cache_bytes}` is smaller than the prefixes running requests keep "
                    f"pinned ({self.store.stored_bytes} bytes stored); lower it once they finish."
                )
            self.options = options

    def clear_store(self) -> None:
        """Drop every stored entry and the record of evictions (they explain no miss any more; the caller holds
        :meth:`idle`); callers keeping rows across calls see ``epoch`` change."""
        with self.store_lock:
            self.store.clear()
            self.evictions.clear()
            self.epoch += 1

    def pinned_block_ids(self) -> set[int]:
        """Blocks the live requests of the views and of other callers keep pinned."""
        with self.store_lock:
            pinned = {b for view in self.live_views.values() for row in view.live.request.rows for b in row.block_ids}
            for source in self.pinning:
                pinned |= source()
            return pinned

    def _on_removed(self, kind: str, block_hash: BlockHash, boundary_tokens: int, evicted: bool) -> None:
        if evicted:
            self.evictions.record(kind, block_hash, Eviction(boundary_tokens, self.num_requests, self._budget_lowered))
        else:
            self.evictions.forget(kind, block_hash)

    # ------------------------------------------------------------------ counters

    @property
    def num_requests(self) -> int:
        """Requests counted so far."""
        return self.counters["requests"]

    def count_request(self, prompt_tokens: int, hit_tokens: int, reasons=()) -> int:
        """Count a request (summed over its rows) and the reasons of its rows' reports; returns its number."""
        with self.store_lock:
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += prompt_tokens
            self.counters["hit_tokens"] += hit_tokens
            for reason in reasons:
                self.reasons[reason] += 1
            return self.counters["requests"]

    def count_divergence_checkpoint(self) -> None:
        with self.store_lock:
            self.counters["divergence_checkpoints"] += 1

    def count_replayed_reply_tokens(self, num_tokens: int) -> None:
        """Count reply tokens run again as one prefill (:mod:`~hf_hybridcache.generate.reply_replay`)."""
        with self.store_lock:
            self.counters["replayed_reply_tokens"] += num_tokens

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the counters, the store and the tier's counters."""
        with self.store_lock:
            remote = None if self.remote is None else self.remote.counters
            return PrefixCacheStats.snapshot(self.counters, self.store, remote, self.reasons)
