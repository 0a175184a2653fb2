"""RemoteTier: the shared second tier behind one cache's local store, composed of the connection and its breaker
(:mod:`~hf_hybridcache.remote.client`), the namespace (:mod:`~hf_hybridcache.remote.namespace`), the background
writer (:mod:`~hf_hybridcache.remote.writer`) and the read path (:mod:`~hf_hybridcache.remote.fetch`).

The cache calls :func:`attach` once, after its store is built; the store then reports every entry it keeps
(``PrefixStore.on_stored``), and every request's restore calls :meth:`RemoteTier.extend` before its local lookup. A
cache without ``remote=`` has no tier and none of this runs.
"""

from __future__ import annotations

from ..hashing import BlockHash
from ..store import FlopModel, PrefixStore
from .client import CircuitBreaker, TierClient
from .codec import Codec
from .config import RemoteConfig, make_client
from .fetch import Fetcher, TierReach
from .namespace import namespace_seed
from .writer import Publisher


class RemoteTier:
    """The tier of one cache and its salted views.

    Args:
        config: the validated settings.
        store: the cache's local store (entries it keeps are published; fetched ones are inserted into it).
        flops: the model's prefill FLOPs (fetch or recompute).
    """

    def __init__(self, config: RemoteConfig, store: PrefixStore, flops: FlopModel) -> None:
        self.config = config
        self.store = store
        self.client = TierClient(make_client(config), CircuitBreaker(config.breaker_errors, config.retry_after_s))
        codec = Codec(store.spec, config.key_prefix, config.secret)
        self.publisher = Publisher(self.client, codec, config.max_pending_writes)
        self.fetcher = Fetcher(self.client, self.publisher, config, flops)

    @property
    def counters(self) -> dict[str, int]:
        """A copy of the tier's counters (see :data:`~hf_hybridcache.remote.client.COUNTERS`)."""
        with self.client._lock:
            return dict(self.client.counters)

    @property
    def compute_flops_per_s(self) -> float | None:
        """This process's prefill FLOP/s as measured on the cache's own forwards of at least 16 tokens (None until
        one ran); the fetch-or-recompute rule uses it unless ``RemoteConfig.compute_flops_per_s`` is given."""
        return self.fetcher.compute.flops_per_s

    @property
    def codec(self) -> Codec:
        """The keys and values of this tier's entries (``codec.key(kind, block_hash)`` names an entry on the
        server)."""
        return self.publisher.codec

    @property
    def breaker(self) -> CircuitBreaker:
        return self.client.breaker

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued entry is written to the tier (or dropped); False if ``timeout_s`` passed first."""
        return self.publisher.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write the queued entries (up to ``timeout_s``) and stop the background writer thread, e.g. before
        dropping a cache in a long-lived process; publishing again later restarts it. False if not all were written
        in time."""
        return self.publisher.close(timeout_s)

    def extend(self, token_ids: list[int], root: BlockHash) -> TierReach:
        """Before the local lookup of ``token_ids`` under ``root``: insert what the tier holds beyond the local hit
        when fetching it is measured faster than recomputing it; returns what the tier held
        (:meth:`~hf_hybridcache.remote.fetch.Fetcher.extend`)."""
        return self.fetcher.extend(self.store, token_ids, root)

    def probe(self, token_ids: list[int], root: BlockHash) -> TierReach:
        """What :meth:`extend` would find and decide, leaving no trace and inserting nothing (a dry run)."""
        return self.fetcher.probe(self.store, token_ids, root)

    def observe_forward(self, start_tokens: int, end_tokens: int, seconds: float) -> None:
        """The cache's forward of tokens ``[start_tokens, end_tokens)`` of one row took ``seconds`` (wall time, the
        devices synchronized): feeds the measured compute rate of the fetch-or-recompute rule."""
        self.fetcher.observe_forward(start_tokens, end_tokens, seconds)

    def publish_all(self) -> None:
        """Queue every entry the local store holds, waiting for room in the writer's queue (a cache loaded from a
        file publishes what it loaded; not for a request's path)."""
        for block_id in sorted(self.store.kv.block_ids()):
            self.on_stored("kv", block_id, wait=True)
        for block_id in sorted(self.store.checkpoints.block_ids()):
            self.on_stored("checkpoint", block_id, wait=True)

    def on_stored(self, kind: str, block_id: int, wait: bool = False) -> None:
        """The store kept a new KV block (``kind == "kv"``) or checkpoint at the end of ``block_id``: publish it
        (``wait``: for room in a full queue instead of dropping it)."""
        block = self.store.pool[block_id]
        if kind == "kv":
            # Pages are reused after an eviction, and the writer encodes later: publish a copy of the block's page.
            entry = {idx: (keys.clone(), values.clone()) for idx, (keys, values) in self.store.kv.get(block_id).items()}
        else:
            entry = self.store.checkpoints.get(block_id)
        self.publisher.publish(kind, block.block_hash, block.token_ids, entry, wait)


def attach(cache, config: RemoteConfig | None, seed_given: bool) -> RemoteTier | None:
    """Give ``cache`` (a new :class:`~hf_hybridcache.HybridPrefixCache`, store built, no view started) its tier:
    the namespace seed (:mod:`~hf_hybridcache.remote.namespace`) unless the seed was given, and the store's hook.
    None when ``config`` is None. Nothing is sent to the server yet.

    Raises:
        ImportError: redis-py is not installed.
    """
    if config is None:
        return None
    tier = RemoteTier(config, cache.store, FlopModel.from_model(cache.model, cache.spec))
    if not seed_given:
        cache.core.seed = namespace_seed(config.key_prefix, cache.core.identity)
        cache.store.root = cache.core.root(None)
    cache.store.on_stored = tier.on_stored
    return tier
