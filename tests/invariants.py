"""DESIGN.md's store invariants, checked from the outside after any operation (shared by the fuzz, thread and
persistence tests and the soak benchmark)."""

from __future__ import annotations

import hashlib

import torch

from hf_hybridcache.hashing import block_hash


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _entries(cache):
    """``(kind, block id, block hash, entry)`` for every stored entry; ``entry`` is the store's own dict of tensors."""
    store = cache._store
    for block_id in store.pool.block_ids():
        h = store.pool[block_id].block_hash
        yield "kv", block_id, h, store.kv.get(block_id)
        if block_id in store.checkpoints:
            yield "checkpoint", block_id, h, store.checkpoints.get(block_id)


def _entry_digest(entry) -> str:
    return _digest(t for idx in sorted(entry) for t in (entry[idx] if isinstance(entry[idx], tuple) else [entry[idx]]))


def entry_digests(cache) -> dict[tuple[str, bytes], str]:
    """SHA-256 of every stored entry keyed by (kind, block hash): ``"kv"`` over its KV tensors, ``"checkpoint"``
    over its conv and SSM states. Block hashes do not depend on block ids, so a saved cache and the cache loaded from
    its file compare equal."""
    return {(kind, h): _entry_digest(entry) for kind, _, h, entry in _entries(cache)}


def check_store(cache, before: dict | None = None) -> dict:
    """Assert the invariants and return a snapshot of the entries (pass it as ``before`` next time).

    - the budget is never exceeded, and ``stored_bytes`` is the bytes of the stored tensors;
    - the stored blocks form a tree (every parent stored), each with its KV, and every checkpoint belongs to a stored
      block, so a hit can never cross a missing piece;
    - every block's hash chains from its parent's hash and its token ids;
    - an entry that was stored before and still is was never written (same checksum): restores copy, decode writes
      only the live cache;
    - between requests nothing is pinned except the chain of the store's last request.
    """
    store = cache._store
    assert store.stored_bytes <= store.max_cache_bytes, f"{store.stored_bytes} bytes over {store.max_cache_bytes}"
    actual = 0
    for block_id in store.pool.block_ids():
        actual += sum(t.numel() * t.element_size() for t in store.kv.get(block_id).values())
        if block_id in store.checkpoints:
            states = store.checkpoints.get(block_id).values()
            actual += sum(t.numel() * t.element_size() for pair in states for t in pair)
    assert actual == store.stored_bytes, "stored_bytes is not the bytes of the stored tensors"
    assert len(store.kv) == len(store.pool), "a stored block without KV (or KV without a block)"
    for block_id in store.pool.block_ids():
        block = store.pool[block_id]
        assert block_id in store.kv
        if block.parent_id is not None:
            parent = store.pool[block.parent_id]  # KeyError: an orphaned block
            assert block_hash(parent.block_hash, block.token_ids) == block.block_hash, "a hash does not chain"
    assert set(store.kv.block_ids()) == set(store.pool.block_ids()), "stored KV and stored blocks differ"
    assert set(store.checkpoints.block_ids()) <= set(store.pool.block_ids()), "a checkpoint without its block"
    # An entry is the store's dict of tensors: one that is still the same object must still hold the same values (a
    # checkpoint dropped and stored again for the same block is a new object, recomputed maybe in another batch).
    now = {(kind, block_id): (entry, _entry_digest(entry)) for kind, block_id, _, entry in _entries(cache)}
    if before is not None:
        same = [key for key in now.keys() & before.keys() if now[key][0] is before[key][0]]
        changed = [key for key in same if now[key][1] != before[key][1]]
        assert not changed, f"stored entries were written: {changed[:3]}"
    active = cache._shared.active
    rows = active._request.rows if active is not None and active._request is not None else []
    pinned = {block_id for row in rows for block_id in row.block_ids}
    for block_id in store.pool.block_ids():
        assert store.pool[block_id].ref_count == 0 or block_id in pinned, f"block {block_id} is pinned by nobody"
    return now
