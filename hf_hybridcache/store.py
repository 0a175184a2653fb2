"""PrefixStore: what outlives a request — stored KV blocks and checkpoints under one byte budget.

It composes the block pool (bookkeeping), the KV store and the checkpoint store (tensors) and the eviction policy,
and answers the one question a new request asks: how long a prefix of these tokens can be restored?
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .block_pool import BlockPool
from .checkpoints import CheckpointStore, LayerState
from .config import ModelStateSpec
from .hashing import BlockHash, block_hash
from .kv_store import KVStore
from .placement import Placement
from .policy import EntryKey, LRUEviction


@dataclass(frozen=True)
class Hit:
    """A restorable prefix: ``hit_tokens`` tokens, the block ids and hashes of ``[0, hit_tokens)``."""

    hit_tokens: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]


MISS = Hit(0, (), ())


class PrefixStore:
    """Stored KV blocks and checkpoints of one model, never more than ``max_cache_bytes`` in all.

    Args:
        spec: layers and per-entry byte sizes of the model.
        root: parent hash of block 0 (seed + model identity) for chains without a cache salt; salted chains pass
            their own root (:func:`~hf_hybridcache.hashing.root_hash` with the salt).
        max_cache_bytes: the budget, bytes of the stored tensors.
        placement: where stored tensors are kept and where restored copies go (None: where they are given).
    """

    def __init__(
        self, spec: ModelStateSpec, root: BlockHash, max_cache_bytes: int, placement: Placement | None = None
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.root = root
        self.max_cache_bytes = max_cache_bytes
        self.pool = BlockPool()
        self.kv = KVStore(tuple(a.layer_idx for a in spec.attention), placement)
        self.checkpoints = CheckpointStore(tuple(m.layer_idx for m in spec.mamba), placement)
        self.eviction = LRUEviction()
        self.evicted_kv_blocks = 0
        self.evicted_checkpoints = 0

    @property
    def stored_bytes(self) -> int:
        return self.kv.num_bytes + self.checkpoints.num_bytes

    # ------------------------------------------------------------------ lookup and restore

    def lookup(self, token_ids: list[int], root: BlockHash | None = None) -> Hit:
        """Longest hit P <= L-1, a multiple of ``block_size``, with every KV block of ``[0, P)`` stored and a
        checkpoint at P; backs off past missing checkpoints down to a miss. Only chains grown from ``root`` (None:
        the unsalted root) are searched. Touches what it returns."""
        bs = self.block_size
        chain: list[int] = []
        hashes: list[BlockHash] = []
        parent_hash, parent_id = self.root if root is None else root, None
        for start in range(0, len(token_ids) - bs, bs):
            tokens = tuple(token_ids[start : start + bs])
            parent_hash = block_hash(parent_hash, tokens)
            parent_id = self.pool.lookup(parent_hash, parent_id, tokens)
            if parent_id is None:
                break
            chain.append(parent_id)
            hashes.append(parent_hash)
        for depth in range(len(chain), 0, -1):
            if chain[depth - 1] in self.checkpoints:
                self.eviction.touch_chain(chain[:depth])
                self.eviction.touch(("checkpoint", chain[depth - 1]))
                return Hit(depth * bs, tuple(chain[:depth]), tuple(hashes[:depth]))
        return MISS

    def gather_kv(self, layer_idx: int, block_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values ``[1, Hkv, len(block_ids) * block_size, D]`` of one attention layer."""
        return self.kv.gather(layer_idx, list(block_ids))

    def checkpoint_copy(self, block_id: int) -> dict[int, LayerState]:
        """A copy of the checkpoint at the end of ``block_id``: ``{mamba layer idx: (conv, ssm)}``."""
        return self.checkpoints.get_copy(block_id)

    # ------------------------------------------------------------------ adding entries

    def add_block(
        self,
        parent_id: int | None,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        make_kv: Callable[[], dict[int, torch.Tensor]],
    ) -> tuple[int, BlockHash] | None:
        """Find or store the block of ``token_ids`` after ``parent_id`` and pin it (unpin with :meth:`release`).
        ``parent_hash`` is the parent's hash, or for block 0 the chain's root (None: the unsalted root). ``make_kv``
        is called only when the block is new and fits. Returns (block id, hash), or None if it cannot fit."""
        h = block_hash(self.root if parent_hash is None else parent_hash, token_ids)
        block_id = self.pool.lookup(h, parent_id, token_ids)
        if block_id is None:
            if not self.make_room(self.spec.kv_block_bytes):
                return None
            block_id = self.pool.add(h, parent_id, token_ids)
            self.kv.put(block_id, make_kv())
        self.pool.ref([block_id])
        self.eviction.touch(("kv", block_id))
        return block_id, h

    def add_checkpoint(self, block_id: int, states: dict[int, LayerState]) -> bool | None:
        """Store ``states`` (copies) as the checkpoint at the end of ``block_id``. Returns True if stored now, False
        if one was already there (it is touched), None if it cannot fit."""
        if block_id in self.checkpoints:
            self.eviction.touch(("checkpoint", block_id))
            return False
        if not self.make_room(self.spec.checkpoint_bytes):
            return None
        self.checkpoints.put(block_id, states)
        self.eviction.touch(("checkpoint", block_id))
        return True

    def pin(self, block_ids) -> None:
        self.pool.ref(block_ids)

    def release(self, block_ids: list[int]) -> None:
        """Unpin a finished request's chain (root first) and mark it used, leaf first."""
        self.pool.unref(block_ids)
        self.eviction.touch_chain(block_ids)

    # ------------------------------------------------------------------ budget and eviction

    def make_room(self, num_bytes: int) -> bool:
        """Evict least-recently-used entries until ``num_bytes`` more fit. False if they cannot fit (pinned blocks
        are never evicted)."""
        while self.stored_bytes + num_bytes > self.max_cache_bytes:
            victim = next((key for key in self.eviction.oldest_first() if self._is_evictable(key)), None)
            if victim is None:
                return False
            kind, block_id = victim
            if kind == "checkpoint":
                self.drop_checkpoint(block_id)
                self.evicted_checkpoints += 1
            else:
                self._evict_block(block_id)
        return True

    def _is_evictable(self, key: EntryKey) -> bool:
        kind, block_id = key
        return kind == "checkpoint" or self.pool.is_evictable(block_id)

    def drop_checkpoint(self, block_id: int) -> None:
        if block_id in self.checkpoints:
            self.checkpoints.remove(block_id)
            self.eviction.discard(("checkpoint", block_id))

    def _evict_block(self, block_id: int) -> None:
        if block_id in self.checkpoints:
            self.drop_checkpoint(block_id)
            self.evicted_checkpoints += 1
        self.kv.remove(block_id)
        self.pool.remove(block_id)
        self.eviction.discard(("kv", block_id))
        self.evicted_kv_blocks += 1

    def clear(self) -> None:
        """Drop every stored entry (pinned ones too: call between requests)."""
        self.pool.clear()
        self.kv.clear()
        self.checkpoints.clear()
        self.eviction.clear()
