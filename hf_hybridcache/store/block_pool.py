"""Block bookkeeping: ids, the hash -> block map, the parent -> children index, reference counts and the set of
evictable blocks (unreferenced leaves), whose changes it reports to a listener (the eviction queue). No tensors.

A block is ``block_size`` consecutive tokens whose KV is stored; it is addressed by its chained block hash
(:mod:`hf_hybridcache.hashing`). Layout after nano-vllm's block manager and vLLM's ``block_pool.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..hashing import BlockHash


@dataclass
class Block:
    block_id: int
    block_hash: BlockHash
    parent_id: int | None
    token_ids: tuple[int, ...]
    depth: int = 0
    children: set[int] = field(default_factory=set)
    ref_count: int = 0

    @property
    def end_blocks(self) -> int:
        """Blocks in the prefix this block ends (``end_blocks * block_size`` is the boundary it ends at)."""
        return self.depth + 1

    @property
    def is_leaf(self) -> bool:
        return not self.children


class BlockPool:
    """Stored blocks as a tree of prefixes. A block may only be removed when it is a leaf and unreferenced; the set
    of such blocks is kept up to date, so eviction never scans the whole tree.

    Args:
        on_evictable: called with ``(block_id, True)`` when a block becomes an unreferenced leaf and ``(block_id,
            False)`` when it stops being one (referenced, extended or removed); not called by :meth:`clear`.
    """

    def __init__(self, on_evictable: Callable[[int, bool], None] | None = None) -> None:
        self._blocks: dict[int, Block] = {}
        self._by_hash: dict[BlockHash, int] = {}
        self._evictable: set[int] = set()
        self._next_id = 0
        self._on_evictable = on_evictable

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def __getitem__(self, block_id: int) -> Block:
        return self._blocks[block_id]

    def block_ids(self) -> list[int]:
        return list(self._blocks)

    def has_hash(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hash: BlockHash, parent_id: int | None, token_ids: tuple[int, ...]) -> int | None:
        """The stored block with this hash, parent and tokens, or None. Re-comparing the token ids and the parent
        means a hash collision can never serve another prefix's data."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        block = self._blocks[block_id]
        if block.parent_id != parent_id or block.token_ids != token_ids:
            return None
        return block_id

    def add(self, block_hash: BlockHash, parent_id: int | None, token_ids: tuple[int, ...]) -> int:
        """Register a new block; its parent must be stored. Returns the new block id."""
        assert block_hash not in self._by_hash, "block hash already stored; look it up first"
        assert parent_id is None or parent_id in self._blocks, "a block's parent must be stored before it"
        block_id = self._next_id
        self._next_id += 1
        depth = 0 if parent_id is None else self._blocks[parent_id].depth + 1
        self._blocks[block_id] = Block(block_id, block_hash, parent_id, token_ids, depth)
        self._by_hash[block_hash] = block_id
        if parent_id is not None:
            self._blocks[parent_id].children.add(block_id)
            self._unmark(parent_id)
        self._mark(block_id)
        return block_id

    def remove(self, block_id: int) -> None:
        block = self._blocks[block_id]
        assert block.is_leaf and block.ref_count == 0, "only unreferenced leaf blocks can be removed"
        del self._blocks[block_id]
        del self._by_hash[block.block_hash]
        self._unmark(block_id)
        if block.parent_id is not None:
            parent = self._blocks[block.parent_id]
            parent.children.discard(block_id)
            self._update_evictable(parent)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def evictable_ids(self) -> set[int]:
        """Ids of the unreferenced leaf blocks (a live view: copy it before removing blocks while iterating)."""
        return self._evictable

    def ref(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._blocks[block_id].ref_count += 1
            self._unmark(block_id)

    def unref(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_count > 0, "unref of an unreferenced block"
            block.ref_count -= 1
            self._update_evictable(block)

    def _update_evictable(self, block: Block) -> None:
        if block.is_leaf and block.ref_count == 0:
            self._mark(block.block_id)

    def _mark(self, block_id: int) -> None:
        if block_id not in self._evictable:
            self._evictable.add(block_id)
            if self._on_evictable is not None:
                self._on_evictable(block_id, True)

    def _unmark(self, block_id: int) -> None:
        if block_id in self._evictable:
            self._evictable.discard(block_id)
            if self._on_evictable is not None:
                self._on_evictable(block_id, False)

    def clear(self) -> None:
        self._blocks.clear()
        self._by_hash.clear()
        self._evictable.clear()
