"""DESIGN.md's store invariants, checked from the outside after any operation: used by the tests (fuzzing, threads,
persistence) and the soak benchmark, and usable as a health check of a long-running cache (it reads every stored
tensor, so it costs about one pass over the stored bytes; call it between requests)."""

from __future__ import annotations

import hashlib

import torch

from ..config import split_state_key
from ..hashing import block_hash


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _require(condition: bool, message: str) -> None:
    """Raise even under ``python -O`` (a health check must not vanish with asserts)."""
    if not condition:
        raise AssertionError(message)


def _entries(blocks):
    """``(kind, block id, block hash, entry)`` for every stored entry; ``entry`` is the store's own dict of tensors."""
    for block in blocks:
        yield "kv", block.block_id, block.block_hash, block.kv
        if block.checkpoint is not None:
            yield "checkpoint", block.block_id, block.block_hash, block.checkpoint


def _tensors(entry):
    """An entry's tensors in layer order: KV ``{idx: tensor}`` or a checkpoint ``{state key: (conv, ssm)}``."""
    for idx in sorted(entry, key=split_state_key):
        value = entry[idx]
        yield from value if isinstance(value, tuple) else (value,)


def _num_bytes(entry) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(entry))


def _entry_digest(entry) -> str:
    return _digest(_tensors(entry))


def entry_digests(cache) -> dict[tuple[str, bytes], str]:
    """SHA-256 of every stored entry keyed by (kind, block hash): ``"kv"`` over its KV tensors, ``"checkpoint"``
    over its conv and SSM states. Block hashes do not depend on block ids, so a saved cache and the cache loaded from
    its file compare equal."""
    return {(kind, h): _entry_digest(entry) for kind, _, h, entry in _entries(cache.store.blocks())}


def check_store(cache, before: dict | None = None) -> dict:
    """Assert the invariants and return a snapshot of the entries (pass it as ``before`` next time).

    - the budget is never exceeded, and ``stored_bytes`` is the bytes of the stored tensors;
    - the stored blocks form a tree (every parent stored), each with its KV, and every checkpoint belongs to a stored
      block, so a hit can never cross a missing piece;
    - every block's hash chains from its parent's hash and its token ids;
    - an entry that was stored before and still is was never written (same checksum): restores copy, decode writes
      only the live cache;
    - nothing is pinned except the chains of live requests (each view's last one, a serving engine's running ones).

    Raises:
        AssertionError: naming the invariant that does not hold.
    """
    with cache.core.store_lock:  # one state of the store, between two store operations of any caller
        store = cache.core.store
        over = f"{store.stored_bytes} bytes stored over the budget of {store.max_cache_bytes}"
        _require(store.stored_bytes <= store.max_cache_bytes, over)
        pool_ids, kv_ids, checkpoint_ids = store.stored_ids()
        _require(kv_ids == pool_ids, "stored KV and stored blocks differ (a block without KV or KV without a block)")
        _require(checkpoint_ids <= pool_ids, "a checkpoint without its block")
        blocks = {block.block_id: block for block in store.blocks()}
        actual = sum(_num_bytes(entry) for _, _, _, entry in _entries(blocks.values()))
        _require(actual == store.stored_bytes, "stored_bytes is not the bytes of the stored tensors")
        for block in blocks.values():
            if block.parent_id is not None:
                _require(block.parent_id in blocks, f"block {block.block_id}'s parent is not stored")
                parent_hash = blocks[block.parent_id].block_hash
                _require(block_hash(parent_hash, block.token_ids) == block.block_hash, "a hash does not chain")
        # A KV block keeps its id and its page for life, so one stored before and still must hold the same values; a
        # checkpoint is the store's dict of tensors, and one that is still the same object must too (a checkpoint
        # dropped and stored again for the same block is a new object, maybe recomputed in a batch).
        now = {(kind, b): (entry, _entry_digest(entry)) for kind, b, _, entry in _entries(blocks.values())}
        if before is not None:
            same = [key for key in now.keys() & before.keys() if key[0] == "kv" or now[key][0] is before[key][0]]
            changed = [key for key in same if now[key][1] != before[key][1]]
            _require(not changed, f"stored entries were written: {changed[:3]}")
        pinned = cache.core.pinned_block_ids()
        for block in blocks.values():
            _require(block.ref_count == 0 or block.block_id in pinned, f"block {block.block_id} is pinned by nobody")
        return now
