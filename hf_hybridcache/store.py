"""PrefixStore: what outlives a request — stored KV blocks and checkpoints under one byte budget.

It composes the block pool (bookkeeping), the KV store and the checkpoint store (tensors) and the eviction policy,
and answers the one question a new request asks: how long a prefix of these tokens can be restored?
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .block_pool import BlockPool
from .checkpoints import CheckpointStore, LayerState
from .config import ModelStateSpec
from .hashing import BlockHash, block_hash
from .kv_store import KVStore
from .placement import Placement
from .policy import EntryKey, EntryValue, EvictionPolicy, LRUEviction

logger = logging.getLogger("hf_hybridcache")


@dataclass(frozen=True)
class Hit:
    """A restorable prefix: ``hit_tokens`` tokens, the block ids and hashes of ``[0, hit_tokens)``.

    ``divergence_tokens`` is the block boundary past the hit where the prompt leaves an already stored token path (a
    stored block continues that prefix differently from the prompt's next full block), or 0 when there is none.
    """

    hit_tokens: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    divergence_tokens: int = 0


class PrefixStore:
    """Stored KV blocks and checkpoints of one model, never more than ``max_cache_bytes`` in all.

    Args:
        spec: layers and per-entry byte sizes of the model.
        root: parent hash of block 0 (seed + model identity) for chains without a cache salt; salted chains pass
            their own root (:func:`~hf_hybridcache.hashing.root_hash` with the salt).
        max_cache_bytes: the budget, bytes of the stored tensors.
        placement: where stored tensors are kept and where restored copies go (None: where they are given).
        eviction: ranks what to evict; least recently used when None.
    """

    def __init__(
        self,
        spec: ModelStateSpec,
        root: BlockHash,
        max_cache_bytes: int,
        placement: Placement | None = None,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.root = root
        self.max_cache_bytes = max_cache_bytes
        self.pool = BlockPool()
        self.kv = KVStore(tuple(a.layer_idx for a in spec.attention), placement)
        self.checkpoints = CheckpointStore(tuple(m.layer_idx for m in spec.mamba), placement)
        self.eviction = LRUEviction() if eviction is None else eviction
        self.evicted_kv_blocks = 0
        self.evicted_checkpoints = 0
        # Checkpoint -> the nearest checkpoint before it on its path (None: none), filled as eviction asks.
        self._previous_checkpoint: dict[int, int | None] = {}

    @property
    def stored_bytes(self) -> int:
        return self.kv.num_bytes + self.checkpoints.num_bytes

    # ------------------------------------------------------------------ lookup and restore

    def lookup(self, token_ids: list[int], root: BlockHash | None = None) -> Hit:
        """Longest hit P <= L-1, a multiple of ``block_size``, with every KV block of ``[0, P)`` stored and a
        checkpoint at P; backs off past missing checkpoints down to a miss. Only chains grown from ``root`` (None:
        the unsalted root) are searched. Touches what it returns.

        Also finds the divergence point (Marconi's admission rule): the prompt's full blocks match stored blocks up
        to D tokens, the stored block at D has children, and none of them is the prompt's next full block. A prompt
        that only extends a stored path (the matched block is a leaf) or ends inside it has none."""
        bs = self.block_size
        chain: list[int] = []
        hashes: list[BlockHash] = []
        parent_hash, parent_id = self.root if root is None else root, None
        for start in range(0, len(token_ids) - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            parent_hash = block_hash(parent_hash, tokens)
            parent_id = self.pool.lookup(parent_hash, parent_id, tokens)
            if parent_id is None:
                break
            chain.append(parent_id)
            hashes.append(parent_hash)
        diverges = 0 < len(chain) < len(token_ids) // bs and not self.pool[chain[-1]].is_leaf
        divergence_tokens = len(chain) * bs if diverges else 0
        for depth in range(min(len(chain), (len(token_ids) - 1) // bs), 0, -1):
            if chain[depth - 1] in self.checkpoints:
                self.eviction.touch_chain(chain[:depth])
                self.eviction.touch(("checkpoint", chain[depth - 1]))
                hit_tokens = depth * bs
                return Hit(hit_tokens, tuple(chain[:depth]), tuple(hashes[:depth]),
                           divergence_tokens if divergence_tokens > hit_tokens else 0)
        return Hit(0, (), (), divergence_tokens)

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
        is called only when the block is new and fits. Returns (block id, hash), or None if it cannot fit.

        A new block is refused when its chain's KV plus one checkpoint exceeds the budget: no checkpoint could ever be
        stored at or past it next to its chain, so it would serve no hit, and storing it (its chain is pinned while
        the request runs) would crowd out the checkpoints of the request's earlier boundaries."""
        h = block_hash(self.root if parent_hash is None else parent_hash, token_ids)
        block_id = self.pool.lookup(h, parent_id, token_ids)
        if block_id is None:
            chain_blocks = 1 if parent_id is None else self.pool[parent_id].end_blocks + 1
            if chain_blocks * self.spec.kv_block_bytes + self.spec.checkpoint_bytes > self.max_cache_bytes:
                return None
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
        self._forget_previous(self._find_previous_checkpoint(block_id))  # it may now lie between them
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
        """Evict the entries the eviction policy ranks lowest until ``num_bytes`` more fit. False if they cannot fit
        (pinned blocks are never evicted)."""
        while self.stored_bytes + num_bytes > self.max_cache_bytes:
            candidates = self.eviction_candidates()
            if not candidates:
                return False
            kind, block_id = self.eviction.victim(candidates, self.entry_value)
            logger.debug("evicting the %s at %d tokens", kind, self.pool[block_id].end_blocks * self.block_size)
            if kind == "checkpoint":
                self.drop_checkpoint(block_id)
                self.evicted_checkpoints += 1
            else:
                self.kv.remove(block_id)
                self.pool.remove(block_id)
                self.eviction.discard(("kv", block_id))
                self.evicted_kv_blocks += 1
        return True

    def eviction_candidates(self) -> list[EntryKey]:
        """Every checkpoint and every unreferenced leaf KV block without a checkpoint."""
        checkpoints = [("checkpoint", b) for b in self.checkpoints.block_ids()]
        return checkpoints + [("kv", b) for b in self.pool.evictable_ids() if b not in self.checkpoints]

    def entry_value(self, key: EntryKey) -> EntryValue:
        """``(start_tokens, end_tokens, num_bytes)``: a hit recomputes ``[start, end)`` without this entry. A
        checkpoint at ``end`` backs hits off to the nearest checkpoint before it; a candidate KV block (a leaf
        without a checkpoint) serves no hit, so its span is empty."""
        kind, block_id = key
        end_tokens = self.pool[block_id].end_blocks * self.block_size
        if kind == "kv":
            return end_tokens, end_tokens, self.kv.block_bytes(block_id)
        if block_id not in self._previous_checkpoint:
            self._previous_checkpoint[block_id] = self._find_previous_checkpoint(block_id)
        previous = self._previous_checkpoint[block_id]
        start_tokens = 0 if previous is None else self.pool[previous].end_blocks * self.block_size
        return start_tokens, end_tokens, self.checkpoints.checkpoint_bytes(block_id)

    def _find_previous_checkpoint(self, block_id: int) -> int | None:
        parent = self.pool[block_id].parent_id
        while parent is not None and parent not in self.checkpoints:
            parent = self.pool[parent].parent_id
        return parent

    def _forget_previous(self, block_id: int | None) -> None:
        """Forget the cached previous checkpoint of every checkpoint whose previous one is ``block_id``."""
        stale = [b for b, previous in self._previous_checkpoint.items() if previous == block_id]
        for b in stale:
            del self._previous_checkpoint[b]

    def drop_checkpoint(self, block_id: int) -> None:
        if block_id in self.checkpoints:
            self.checkpoints.remove(block_id)
            self._previous_checkpoint.pop(block_id, None)
            self._forget_previous(block_id)
            self.eviction.discard(("checkpoint", block_id))

    def clear(self) -> None:
        """Drop every stored entry (pinned ones too: call between requests)."""
        self.pool.clear()
        self.kv.clear()
        self.checkpoints.clear()
        self.eviction.clear()
        self._previous_checkpoint.clear()
