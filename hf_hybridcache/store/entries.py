"""The store's entries as records, for saving and loading a cache (:mod:`hf_hybridcache.core.persistence`) and for the
invariant checker (:mod:`hf_hybridcache.core.checks`): one :class:`StoredBlock` per block, with its KV and its
checkpoint, exported and imported by :class:`StoredEntries`, the base class of the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..hashing import BlockHash
from .block_pool import BlockPool
from .checkpoints import CheckpointStore, LayerState
from .eviction import EntryKey, EvictionPolicy
from .kv_store import KVStore


@dataclass(frozen=True)
class StoredBlock:
    """One stored block.

    Attributes:
        block_id, parent_id: ids in the store (or, for :func:`import_entries`, any numbering of the given blocks).
        token_ids: the block's ``block_size`` tokens.
        block_hash: its chained hash.
        kv: ``{attention layer idx: (keys [Hkv, block_size, Dk], values [Hkv, block_size, Dv])}``.
        checkpoint: ``{mamba layer idx: (conv [1, C, W], ssm [1, ...])}`` at the block's end, or None.
        ref_count: requests pinning it (exported only; imported blocks are unpinned).
    """

    block_id: int
    parent_id: int | None
    token_ids: tuple[int, ...]
    block_hash: BlockHash
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    checkpoint: dict[int, LayerState] | None = None
    ref_count: int = 0


class StoredEntries:
    """The store's entries as records: the base class of :class:`~hf_hybridcache.store.PrefixStore`, which sets
    ``pool``, ``kv``, ``checkpoints``, ``eviction`` and ``max_cache_bytes`` and defines ``stored_bytes``, ``clear`` and
    ``_put_checkpoint`` (storing a checkpoint with its links and eviction value)."""

    pool: BlockPool
    kv: KVStore
    checkpoints: CheckpointStore
    eviction: EvictionPolicy
    max_cache_bytes: int

    def export_entries(self) -> tuple[list[StoredBlock], list[EntryKey]]:
        """Every stored block, parents before children, with its tensors (the store's own: read, never write), and
        every entry ``(kind, block id)`` from least to most recently used."""
        return list(self.blocks()), self.eviction.oldest_first()

    def blocks(self) -> Iterator[StoredBlock]:
        """Every stored block, parents before children (ids grow and a parent is stored before its children), with
        the store's own tensors."""
        for block_id in sorted(self.pool.block_ids()):
            block = self.pool[block_id]
            checkpoint = self.checkpoints.get(block_id) if block_id in self.checkpoints else None
            yield StoredBlock(block_id, block.parent_id, block.token_ids, block.block_hash, self.kv.get(block_id),
                              checkpoint, block.ref_count)

    def import_entries(self, blocks: Sequence[StoredBlock], recency: Sequence[EntryKey]) -> dict[int, int]:
        """Insert ``blocks`` (parents before children, ids and parent ids in the caller's numbering; tensors the store
        may keep) into an empty store, then mark them used in ``recency`` order (oldest first; it must list every
        block's KV and checkpoint). Nothing is evicted: the entries must fit the budget. Returns ``{given id: store
        id}``.

        Raises:
            ValueError: the store is not empty, a parent is not given before its child, or the entries exceed the
                budget.
        """
        if len(self.pool):
            raise ValueError("import_entries fills an empty store; call clear() first.")
        new_ids: dict[int, int] = {}
        for block in blocks:
            if block.parent_id is not None and block.parent_id not in new_ids:
                raise ValueError(f"block {block.block_id}'s parent {block.parent_id} is not given before it.")
            parent = None if block.parent_id is None else new_ids[block.parent_id]
            block_id = self.pool.add(block.block_hash, parent, tuple(block.token_ids))
            new_ids[block.block_id] = block_id
            self.kv.put(block_id, block.kv)
            if block.checkpoint is not None:
                self._put_checkpoint(block_id, block.checkpoint)
        for kind, block_id in recency:
            self.eviction.touch((kind, new_ids[block_id]))
        if self.stored_bytes > self.max_cache_bytes:
            self.clear()
            raise ValueError(
                f"the entries need more than the budget of {self.max_cache_bytes} bytes; nothing was kept."
            )
        return new_ids
