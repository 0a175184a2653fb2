"""What a :class:`~hf_hybridcache.HybridPrefixCache`, its salted views and any other caller of the store share
(:class:`CacheCore`), and the lock that serializes them.

Threading model: a cache and every view made by ``with_salt`` share one core: one store and one re-entrant lock.

- A ``generate()`` call holds the lock from start to end, so calls from several threads (a Gradio or FastAPI app)
  run one at a time and each sees a consistent store; the live state of a call is its view's live layers.
- Every forward with the cache holds the lock for that forward (re-entrant inside the thread's own ``generate()``);
  both are released in ``finally`` blocks, so a ``KeyboardInterrupt`` or ``SystemExit`` inside a call leaves no lock
  held.
- ``save()``, ``clear()``, ``reset()``, ``stats`` and budget changes take the lock too, so they wait for a running
  call. From inside a running ``generate()`` (a streamer or stopping criterion, same thread) the operations that would
  change the store under it, and a second ``generate()`` with the same cache, raise ``RuntimeError`` at once instead
  of deadlocking or corrupting the call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .config import CacheOptions, ModelStateSpec, StateKey
from .hashing import BlockHash, root_hash
from .kernels.paged_copy import KVBlock
from .placement import Placement, layer_devices
from .rows import Row, store_row_blocks, store_row_checkpoint
from .stats import PrefixCacheStats
from .store import EvictionPolicy, Hit, LayerState, PrefixStore
from .weights import WeightsTracker

if TYPE_CHECKING:
    from .remote import RemoteTier

logger = logging.getLogger("hf_hybridcache")


def hash_seed(seed: bytes | None) -> bytes:
    """``seed``, or 32 random bytes when it is None.

    Raises:
        ValueError: ``seed`` is neither bytes nor None.
    """
    if seed is not None and not isinstance(seed, bytes):
        raise ValueError(f"`seed` must be bytes (e.g. b'my-app') or None for a random one, got {type(seed).__name__}.")
    return os.urandom(32) if seed is None else seed


class CacheCore:
    """What a cache, its :meth:`~hf_hybridcache.HybridPrefixCache.with_salt` views and any other caller of the store
    (a serving engine) share: one store under one budget, the roots of the block hash chains (seed, model identity,
    weights state, salt), the remote tier, the counters and the lock. Nothing else reaches these.

    A request, whoever runs it, goes through it in this order, holding ``lock``:

    1. ``root = core.request_root(salt)``: re-read the weights state; the root of the request's chains.
    2. ``hit = core.lookup(token_ids, root)``: the longest restorable prefix (extended from the tier first).
    3. Copy the hit into the request's own state (``core.store.gather_kv``, ``core.store.checkpoint_copy``; a stored
       entry is never written), then ``core.pin(hit.block_ids)`` so that nothing evicts the chain under the request.
    4. ``core.count_request(prompt_tokens, hit_tokens)``.
    5. As the request computes: ``core.store_blocks(row, ...)`` and ``core.store_checkpoint(row, ...)``.
    6. At its end ``core.release(row.block_ids)``: the restored chain and the blocks ``store_blocks`` stored (pinned).

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
        lock: held by every call that reads or changes the store (see the module docstring).
        active: the view whose request is live (its chain is pinned); a new request on any view ends it first.
        generating_thread: the thread inside a ``generate()`` call with this core (:meth:`generate_scope`), or None.
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
        self.lock = threading.RLock()
        self.active = None
        self.generating_thread: int | None = None
        self.warned_masked_prompt = False

    # ------------------------------------------------------------------ roots and the model

    def root(self, salt: str | None) -> BlockHash:
        """The root of the block hash chains of requests under ``salt`` with the current weights state."""
        return root_hash(self.seed, f"{self.identity}|{self.weights.fingerprint}", salt)

    def request_root(self, salt: str | None) -> BlockHash:
        """Re-read the model's weights state (:mod:`~hf_hybridcache.weights`) and return the root a new request
        under ``salt`` chains its blocks from."""
        if self.weights.refresh():
            logger.warning(
                "The model's weights or adapters changed since the last request: prefixes stored under other weights "
                "are not served (they are again if those weights come back; cache.clear() drops them)."
            )
        return self.root(salt)

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a request when ``model`` changed dtype or devices since the cache was built (stored entries would
        not fit it).

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

    # ------------------------------------------------------------------ the store

    def lookup(self, token_ids: list[int], root: BlockHash, tail_tokens: int | None = None) -> Hit:
        """The longest restorable prefix of ``token_ids`` under ``root`` that leaves at least ``tail_tokens`` tokens
        to run (None: the options' ``min_tail_tokens``; :meth:`PrefixStore.lookup
        <hf_hybridcache.store.PrefixStore.lookup>`). With a remote tier, what it holds beyond the local hit is
        inserted into the store first (:mod:`~hf_hybridcache.remote.fetch`), and a path it holds that the prompt
        leaves counts as a divergence point. ``divergence_tokens`` is 0 unless ``admit_divergence`` is on."""
        remote_divergence = 0 if self.remote is None else self.remote.extend(token_ids, root)
        hit = self.store.lookup(token_ids, root, self.options.min_tail_tokens if tail_tokens is None else tail_tokens)
        if not self.options.admit_divergence:
            return replace(hit, divergence_tokens=0)
        remote_divergence = remote_divergence if remote_divergence > hit.hit_tokens else 0
        return replace(hit, divergence_tokens=hit.divergence_tokens or remote_divergence)

    def pin(self, block_ids) -> None:
        """Keep a request's chain ``block_ids`` from eviction until :meth:`release` (pins count per request)."""
        self.store.pin(block_ids)

    def release(self, block_ids: list[int]) -> None:
        """Unpin a chain :meth:`pin` pinned or :meth:`store_blocks` grew."""
        self.store.release(block_ids)

    def store_blocks(self, row: Row, live_block_kv: Callable[[int], dict[int, KVBlock]]) -> None:
        """Store every full block of ``row`` not stored yet, pinned for the request
        (:func:`~hf_hybridcache.rows.store_row_blocks`)."""
        store_row_blocks(self.store, row, live_block_kv)

    def store_checkpoint(self, row: Row, boundary: int, states: dict[StateKey, LayerState], tentative: bool) -> bool:
        """Store ``row``'s state after ``boundary`` tokens (:func:`~hf_hybridcache.rows.store_row_checkpoint`); True
        if a new checkpoint was stored."""
        return store_row_checkpoint(self.store, row, boundary, states, tentative)

    def set_options(self, options: CacheOptions) -> None:
        """Apply ``options`` whose ``max_cache_bytes`` (the only option that changes after construction) may differ:
        what no longer fits the budget is evicted. The caller holds ``lock`` and no chain is pinned."""
        self.store.max_cache_bytes = options.max_cache_bytes
        fits = self.store.make_room(0)
        assert fits, "nothing is pinned between requests, so any budget of at least one entry fits"
        self.options = options

    # ------------------------------------------------------------------ counters

    @property
    def num_requests(self) -> int:
        """Requests counted so far."""
        return self.counters["requests"]

    def count_request(self, prompt_tokens: int, hit_tokens: int) -> int:
        """Count a request (summed over its rows); returns its number."""
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["hit_tokens"] += hit_tokens
        return self.counters["requests"]

    def count_divergence_checkpoint(self) -> None:
        self.counters["divergence_checkpoints"] += 1

    def count_replayed_reply_tokens(self, num_tokens: int) -> None:
        """Count reply tokens run again as one prefill (:mod:`~hf_hybridcache.reply_replay`)."""
        self.counters["replayed_reply_tokens"] += num_tokens

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the counters, the store and the tier's counters (waits for a running call)."""
        with self.lock:
            remote = None if self.remote is None else self.remote.counters
            return PrefixCacheStats.snapshot(self.counters, self.store, remote)

    # ------------------------------------------------------------------ the lock

    @contextlib.contextmanager
    def generate_scope(self):
        """Hold the lock for one ``generate()`` call.

        Raises:
            RuntimeError: this thread is already inside a ``generate()`` call with this cache or one of its views.
        """
        me = threading.get_ident()
        if self.generating_thread == me:
            raise RuntimeError(
                "This HybridPrefixCache is already running a generate() call in this thread (a streamer, logits "
                "processor or stopping criterion calling generate() again?); one cache serves one call at a time, "
                "so call generate() again after the running call returns, or use another HybridPrefixCache."
            )
        with self.lock:
            self.generating_thread = me
            try:
                yield
            finally:
                self.generating_thread = None

    @contextlib.contextmanager
    def idle(self, operation: str):
        """Hold the lock for an operation that changes the store (waits for a call running in another thread).

        Raises:
            RuntimeError: called from inside a running ``generate()`` call in this thread.
        """
        if self.generating_thread == threading.get_ident():
            raise RuntimeError(
                f"{operation} cannot run while generate() is running with this HybridPrefixCache in the same thread "
                "(from a streamer or a stopping criterion?); call it after generate() returns."
            )
        with self.lock:
            yield
