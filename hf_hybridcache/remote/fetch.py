"""The read path: before a request's local lookup, extend the local store with the longest chain the tier holds
beyond the local hit, so the usual lookup and restore serve it.

Two round trips at most: one pipeline of ``EXISTS`` over the prompt's successive KV block keys past the locally
stored chain and the checkpoint keys past the local hit; then, if the deepest boundary with a complete KV chain and a
checkpoint (``D``) is worth it, one pipeline of ``GET`` for exactly the blocks ``[local chain, D)`` and the checkpoint
at ``D``. Every value is verified (:meth:`~hf_hybridcache.remote.codec.Codec.decode`) before anything is inserted;
one that fails (corrupt, tampered, unsigned under a secret, vanished since the ``EXISTS``) makes the whole fetch a
miss, so a hit never crosses a missing piece, and one that is present but fails is counted and removed from the tier
(:meth:`~hf_hybridcache.remote.writer.Publisher.remove`), so the next process that computes it replaces it. Any entry
may vanish at any time (the server's ``maxmemory`` policy evicts what it likes), which this order tolerates: what is
missing is simply not there. After vLLM v1's hybrid coordinator, the KV chain is matched left to right and the
checkpoint side searched right to left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..hashing import BlockHash, chain_hashes
from ..store import FlopModel, PrefixStore
from ..store.lookup import hit_blocks, match_blocks
from .client import TierClient
from .config import RemoteConfig
from .rate import ComputeRate
from .writer import Publisher

logger = logging.getLogger("hf_hybridcache")


def worth_fetching(
    saved_flops: float,
    num_bytes: int,
    config: RemoteConfig,
    transfer_seconds: float | None,
    measured_flops_per_s: float | None = None,
) -> bool:
    """Fetch ``num_bytes`` that save ``saved_flops`` of prefill
    (:meth:`~hf_hybridcache.store.flops.FlopModel.span_flops`) only when the FLOPs per byte reach
    ``config.min_flops_per_byte`` and transferring takes less time than recomputing: ``transfer_seconds`` (measured,
    :class:`~hf_hybridcache.remote.rate.TransferRate`) against ``saved_flops`` over the compute rate, which is
    ``config.compute_flops_per_s`` when given, else ``measured_flops_per_s``
    (:class:`~hf_hybridcache.remote.rate.ComputeRate`). Either time unknown yet: fetch (which measures the transfer)."""
    if saved_flops < config.min_flops_per_byte * num_bytes:
        return False
    flops_per_s = config.compute_flops_per_s or measured_flops_per_s
    if flops_per_s is None or transfer_seconds is None:
        return True
    return transfer_seconds < saved_flops / flops_per_s


@dataclass(frozen=True)
class TierReach:
    """What the tier holds for a prompt past the local store, in tokens (all 0 when the local hit is the deepest
    possible or the tier did not answer).

    Attributes:
        kv_tokens: how far the prompt's KV chain reaches in the local store and the tier together, up to the last
            block boundary below the prompt's length.
        checkpoint_tokens: the deepest boundary past the local hit within that chain whose checkpoint the tier holds
            (0: none).
        fetch: what the fetch rule (:func:`worth_fetching`) decided for it; False: recomputing is measured faster.
        divergence_tokens: the boundary where the prompt leaves a KV chain the tier holds past the local store's
            (a divergence point for admission), or 0.
    """

    kv_tokens: int = 0
    checkpoint_tokens: int = 0
    fetch: bool = False
    divergence_tokens: int = 0


class Fetcher:
    """Extends a store from the tier; see the module docstring.

    Args:
        client: the tier's connection.
        publisher: muted while fetched entries are inserted (they are in the tier already); removes values that fail
            verification. Its codec names and verifies the entries.
        config: the tier's settings (fetch rule).
        flops: the model's prefill FLOPs, for :func:`worth_fetching`.

    Attributes:
        compute: this process's measured prefill FLOP/s (:meth:`observe_forward` feeds it).
    """

    def __init__(self, client: TierClient, publisher: Publisher, config: RemoteConfig, flops: FlopModel) -> None:
        self.client = client
        self.compute = ComputeRate()
        self.publisher = publisher
        self.codec = publisher.codec
        self.config = config
        self.flops = flops

    def observe_forward(self, start_tokens: int, end_tokens: int, seconds: float) -> None:
        """The cache's forward of tokens ``[start_tokens, end_tokens)`` of one row took ``seconds``."""
        self.compute.observe(end_tokens - start_tokens, self.flops.span_flops(start_tokens, end_tokens), seconds)

    def extend(self, store: PrefixStore, token_ids: list[int], root: BlockHash) -> TierReach:
        """Insert into ``store`` what the tier holds beyond the local hit of ``token_ids`` under ``root``, when the
        fetch rule says so (:func:`worth_fetching`). Returns what the tier held (:class:`TierReach`)."""
        found = self._probe(store, token_ids, root, record=True)
        if found is None:
            return TierReach()
        reach, local_chain, hashes, local_depth = found
        bs = store.block_size
        depth = reach.checkpoint_tokens // bs
        if depth and reach.fetch:
            self._fetch_and_insert(store, token_ids, root, local_chain, hashes, local_depth, depth)
        elif depth:
            self.client.count("remote_recomputed_tokens", (depth - local_depth) * bs)
            logger.debug(
                "the tier holds a hit of %d tokens; recomputing %d of them is cheaper (compute %s FLOP/s)",
                depth * bs, (depth - local_depth) * bs, self.config.compute_flops_per_s or self.compute.flops_per_s,
            )
        return reach

    def probe(self, store: PrefixStore, token_ids: list[int], root: BlockHash) -> TierReach:
        """What :meth:`extend` would find and decide, with one ``EXISTS`` pipeline that leaves no trace (no counters,
        no rate measured, the breaker untouched); nothing is fetched or inserted."""
        found = self._probe(store, token_ids, root, record=False)
        return TierReach() if found is None else found[0]

    def _probe(self, store: PrefixStore, token_ids: list[int], root: BlockHash, record: bool):
        """``(reach, local chain, the prompt's block hashes, local hit in blocks)``, or None when the local hit is
        the deepest possible or the tier did not answer.

        The divergence point: the boundary where the prompt leaves a KV chain that the tier holds past the local
        store's (another process stored that path). A process whose own store lacks the path cannot see the
        divergence itself, yet a checkpoint there is what lets the next request on any process reuse the shared
        part. When the path merely ended there, its writer kept a checkpoint at its end, which would have been
        fetched instead."""
        bs = store.block_size
        max_depth = (len(token_ids) - 1) // bs
        chain, _ = match_blocks(store.pool, token_ids, root, bs)
        local_depth = hit_blocks(chain, store.checkpoints.__contains__, len(token_ids), bs)
        if local_depth >= max_depth:
            return None
        hashes = chain_hashes(root, token_ids[: max_depth * bs], bs)
        stored = min(len(chain), max_depth)
        found = self._deepest(hashes, stored, local_depth, record)
        if found is None:
            return None
        chain_end, depth = found
        divergence = chain_end * bs if stored < chain_end < len(token_ids) // bs else 0
        fetch = depth is not None and self._worth(store, stored, local_depth, depth)
        reach = TierReach(chain_end * bs, (depth or 0) * bs, fetch, divergence)
        return reach, chain[:stored], hashes, local_depth

    def _worth(self, store: PrefixStore, stored: int, local_depth: int, depth: int) -> bool:
        """The fetch rule for the KV blocks ``[stored, depth)`` and the checkpoint at ``depth`` (in blocks)."""
        num_bytes = max(depth - stored, 0) * store.spec.kv_block_bytes + store.spec.checkpoint_bytes
        saved = self.flops.span_flops(local_depth * store.block_size, depth * store.block_size)
        transfer_seconds = self.client.rate.seconds(num_bytes)
        return worth_fetching(saved, num_bytes, self.config, transfer_seconds, self.compute.flops_per_s)

    def _fetch_and_insert(self, store, token_ids, root, local_chain, hashes, local_depth: int, depth: int) -> None:
        bs, stored = store.block_size, len(local_chain)
        entries = self._fetch(store, token_ids, hashes, stored, depth)
        if entries is None or not _insert(store, self.publisher, token_ids, root, local_chain, hashes, depth, *entries):
            return
        self.client.count("remote_hit_tokens", (depth - local_depth) * bs)
        logger.debug(
            "remote tier: hit grew from %d to %d tokens (%d KV blocks and a checkpoint fetched); tier so far: %s",
            local_depth * bs, depth * bs, max(depth - stored, 0), dict(self.client.counters),
        )

    def _deepest(
        self, hashes: list[BlockHash], stored: int, local_depth: int, record: bool
    ) -> tuple[int, int | None] | None:
        """``(chain_end, depth)``: the blocks of the prompt's KV chain stored here or in the tier, and the deepest
        boundary (in blocks) past ``local_depth`` within it whose checkpoint is in the tier (None if there is none).
        None when the tier did not answer."""
        kv_keys = [self.codec.key("kv", h) for h in hashes[stored:]]
        depths = list(range(local_depth + 1, len(hashes) + 1))
        ck_keys = [self.codec.key("checkpoint", hashes[d - 1]) for d in depths]
        found = self.client.exists(kv_keys + ck_keys, record)
        if found is None:
            return None
        chain_end = stored
        for present in found[: len(kv_keys)]:
            if not present:
                break
            chain_end += 1
        for d, present in reversed(list(zip(depths, found[len(kv_keys) :]))):
            if present and d <= chain_end:
                return chain_end, d
        return chain_end, None

    def _fetch(self, store: PrefixStore, token_ids: list[int], hashes: list[BlockHash], stored: int, depth: int):
        """The verified KV blocks ``[stored, depth)`` and the checkpoint at ``depth``, or None. Every value is
        verified, so that all the unusable ones are counted and removed at once."""
        bs = store.block_size
        wanted = [("kv", i) for i in range(stored, depth)] + [("checkpoint", depth - 1)]
        keys = [self.codec.key(kind, hashes[i]) for kind, i in wanted]
        values = self.client.get(keys)
        if values is None:
            return None
        entries, unusable = [], []
        for (kind, i), key, value in zip(wanted, keys, values):
            entries.append(self.codec.decode(value, kind, hashes[i], token_ids[i * bs : (i + 1) * bs]))
            if entries[-1] is None and value is not None:  # present but unusable (a vanished one is a plain miss)
                unusable.append(key)
        if unusable:
            self.client.count("remote_corrupt_entries", len(unusable))
            self.publisher.remove(unusable)
        if any(entry is None for entry in entries):
            return None
        return entries[:-1], entries[-1]


def _insert(store: PrefixStore, publisher: Publisher, token_ids, root, local_chain, hashes, depth, kvs, states) -> bool:
    """Add the fetched blocks after ``local_chain`` (pinned meanwhile, so making room never evicts it) and the
    checkpoint at ``depth``; everything is unpinned again (the request's lookup pins its hit). True if all fit."""
    bs, added = store.block_size, []
    store.pin(local_chain)
    publisher.muted = True
    try:
        parent_id = local_chain[-1] if local_chain else None
        parent_hash = hashes[len(local_chain) - 1] if local_chain else root
        for i, kv in enumerate(kvs, start=len(local_chain)):
            result = store.add_block(parent_id, parent_hash, tuple(token_ids[i * bs : (i + 1) * bs]), lambda kv=kv: kv)
            if result is None:
                return False
            added.append(result[0])
            parent_id, parent_hash = result
        block_id = (list(local_chain) + added)[depth - 1]
        return store.add_checkpoint(block_id, states) is not None
    finally:
        publisher.muted = False
        store.release(added)
        store.release(list(local_chain))
