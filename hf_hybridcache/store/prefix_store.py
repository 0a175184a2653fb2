"""PrefixStore: what outlives a request — stored KV blocks and checkpoints under one byte budget.

It composes the block pool (bookkeeping), the KV store and the checkpoint store (tensors), the checkpoint links and
the eviction policy, and answers the one question a new request asks: how long a prefix of these tokens can be
restored? Its parts are internal: callers use the methods and properties below (``kv``, ``checkpoints``, ``pool`` and
``eviction`` stay reachable for the cache until it moves to them). Its entries as records (saving, loading, checks)
come from its base class, :class:`~hf_hybridcache.store.entries.StoredEntries`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..config import ModelStateSpec, StateKey
from ..hashing import BlockHash, block_hash
from .block_pool import BlockPool
from .checkpoint_links import CheckpointLinks
from .checkpoints import CheckpointStore, LayerState
from .entries import StoredEntries
from .eviction import EntryKey, EntryValue, EvictionPolicy, LRUEviction
from .kv_store import KVStore
from .lookup import Hit, find_hit
from .placement import Placement

logger = logging.getLogger("hf_hybridcache")


class PrefixStore(StoredEntries):
    """Stored KV blocks and checkpoints of one model, never more than ``max_cache_bytes`` in all.

    Args:
        spec: layers and per-entry byte sizes of the model.
        root: parent hash of block 0 (seed + model identity) for chains without a cache salt; salted chains pass
            their own root (:func:`~hf_hybridcache.hashing.root_hash` with the salt).
        max_cache_bytes: the budget, bytes of the stored tensors (settable; call :meth:`make_room` after shrinking).
        placement: where stored tensors are kept and where restored copies go (None: where they are given).
        eviction: ranks what to evict; least recently used when None.

    Attributes:
        on_stored: called with ``("kv" | "checkpoint", block id)`` after a new KV block or checkpoint is stored (the
            remote tier publishes it); None: nobody listens.
        on_removed: called with ``("kv" | "checkpoint", block hash, boundary in tokens, evicted)`` before a stored
            entry goes: ``evicted`` True when the budget evicts it, False when a checkpoint is dropped (a tentative
            one superseded); :meth:`clear` does not call it. None: nobody listens.
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
        self.pool = BlockPool(self._on_evictable)
        self.kv = KVStore(spec.attention, spec.block_size, placement)
        self.checkpoints = CheckpointStore(tuple(m.key for m in spec.mamba), placement)
        self.eviction = LRUEviction() if eviction is None else eviction
        self.links = CheckpointLinks()
        self.evicted_kv_blocks = 0
        self.evicted_checkpoints = 0
        self.on_stored: Callable[[str, int], None] | None = None
        self.on_removed: Callable[[str, BlockHash, int, bool], None] | None = None

    # ------------------------------------------------------------------ sizes

    @property
    def stored_bytes(self) -> int:
        return self.kv.num_bytes + self.checkpoints.num_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv.num_bytes

    @property
    def checkpoint_bytes(self) -> int:
        return self.checkpoints.num_bytes

    @property
    def num_kv_blocks(self) -> int:
        return len(self.kv)

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpoints)

    @property
    def mamba_layers(self) -> tuple[StateKey, ...]:
        """The state keys (Mamba layer idxs) a checkpoint must cover."""
        return self.checkpoints.mamba_layers

    # ------------------------------------------------------------------ lookup and restore

    def find(self, token_ids: list[int], root: BlockHash | None = None, tail_tokens: int = 1) -> Hit:
        """Longest hit P <= L - ``tail_tokens``, a multiple of ``block_size``, with every KV block of ``[0, P)`` stored
        and a checkpoint at P; backs off past missing checkpoints down to a miss. Only chains grown from ``root`` (None:
        the unsalted root) are searched. Also finds the divergence point
        (:func:`~hf_hybridcache.store.lookup.divergence_tokens`), reported only when it lies past the hit. Changes
        nothing (recency included): what a request would restore, for a dry run."""
        return find_hit(self.pool, self.checkpoints.__contains__, token_ids, self.root if root is None else root,
                        self.block_size, tail_tokens)

    def lookup(self, token_ids: list[int], root: BlockHash | None = None, tail_tokens: int = 1) -> Hit:
        """:meth:`find`, then touch what it returns (the request restores it)."""
        hit = self.find(token_ids, root, tail_tokens)
        if hit.block_ids:
            self.eviction.touch_chain(hit.block_ids)
            self.eviction.touch(("checkpoint", hit.block_ids[-1]))
        return hit

    def gather_kv(
        self, layer_idx: int, block_ids: tuple[int, ...] | torch.Tensor, room_tokens: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys ``[1, Hkv, len(block_ids) * block_size, Dk]`` and values ``[..., Dv]`` of one attention
        layer, with room for ``room_tokens`` more after them (:meth:`~hf_hybridcache.store.kv_store.KVStore.gather`;
        ``block_ids`` may be their :meth:`page_table`)."""
        return self.kv.gather(layer_idx, block_ids if isinstance(block_ids, torch.Tensor) else list(block_ids),
                              room_tokens)

    @property
    def pages(self):
        """The :class:`~hf_hybridcache.store.pages.PagePool` holding the stored KV blocks (a serving engine's running
        requests keep their pages in it too)."""
        return self.kv.pages

    def page_of(self, block_id: int) -> int:
        """The page of :attr:`pages` holding a stored block."""
        return self.kv.page_of(block_id)

    def page_table(self, block_ids) -> torch.Tensor:
        """The pages of stored ``block_ids`` in order, int64 ``[len(block_ids)]``."""
        return self.kv.page_table(block_ids)

    def checkpoint_copy(self, block_id: int) -> dict[int, LayerState]:
        """A copy of the checkpoint at the end of ``block_id``: ``{mamba layer idx: (conv, ssm)}``."""
        return self.checkpoints.get_copy(block_id)

    # ------------------------------------------------------------------ adding entries

    def add_block(
        self,
        parent_id: int | None,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        make_kv: Callable[[], dict[int, torch.Tensor]] | None = None,
        page: int | None = None,
    ) -> tuple[int, BlockHash] | None:
        """Find or store the block of ``token_ids`` after ``parent_id`` and pin it (unpin with :meth:`release`).
        ``parent_hash`` is the parent's hash, or for block 0 the chain's root (None: the unsalted root). Its KV is
        ``make_kv()`` (called only when the block is new and fits; copied into a new page) or, for a serving engine,
        the ``page`` of :attr:`pages` that already holds it (stored by reference, no copy). Returns (block id,
        hash), or None if it cannot fit or another block already has its hash.

        A new block is refused when its chain's KV plus one checkpoint exceeds the budget: no checkpoint could ever be
        stored at or past it next to its chain, so it would serve no hit, and storing it (its chain is pinned while
        the request runs) would crowd out the checkpoints of the request's earlier boundaries."""
        h = block_hash(self.root if parent_hash is None else parent_hash, token_ids)
        block_id = self.pool.lookup(h, parent_id, token_ids)
        if block_id is None and self.pool.has_hash(h):
            # The hash is stored for another prefix (a collision, or a tampered file): lookups re-compare tokens and
            # miss it, and this block cannot be stored beside it, so the rest of the chain is not stored.
            logger.warning("a stored block has this block's hash but other tokens or parent; not storing the chain")
            return None
        if block_id is None:
            chain_blocks = 1 if parent_id is None else self.pool[parent_id].end_blocks + 1
            if chain_blocks * self.spec.kv_block_bytes + self.spec.checkpoint_bytes > self.max_cache_bytes:
                return None
            if not self.make_room(self.spec.kv_block_bytes):
                return None
            block_id = self.pool.add(h, parent_id, token_ids)
            try:
                if page is None:
                    self.kv.put(block_id, make_kv())
                else:
                    self.kv.adopt(block_id, page)
            except BaseException:
                self.pool.remove(block_id)  # no block without its KV: a later lookup would hit it and find none
                raise
            if self.on_stored is not None:
                self.on_stored("kv", block_id)
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
        self._put_checkpoint(block_id, states)
        self.eviction.touch(("checkpoint", block_id))
        if self.on_stored is not None:
            self.on_stored("checkpoint", block_id)
        return True

    def pin(self, block_ids) -> None:
        """Pin blocks (a restored hit's chain) so they cannot be evicted until :meth:`release`."""
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
            key = self.eviction.victim()
            if key is None:
                return False
            kind, block_id = key
            logger.debug("evicting the %s at %d tokens", kind, self.end_tokens(block_id))
            self._removing(kind, block_id, evicted=True)
            if kind == "checkpoint":
                self._drop_checkpoint(block_id)
                self.evicted_checkpoints += 1
            else:
                self.kv.remove(block_id)
                self.pool.remove(block_id)
                self.eviction.discard(key)
                self.evicted_kv_blocks += 1
        return True

    def drop_checkpoint(self, block_id: int) -> None:
        """Drop the checkpoint at the end of ``block_id`` if there is one; its KV stays (hits back off past it)."""
        if block_id in self.checkpoints:
            self._removing("checkpoint", block_id, evicted=False)
            self._drop_checkpoint(block_id)

    def _removing(self, kind: str, block_id: int, evicted: bool) -> None:
        if self.on_removed is not None:
            self.on_removed(kind, self.pool[block_id].block_hash, self.end_tokens(block_id), evicted)

    def _drop_checkpoint(self, block_id: int) -> None:
        self.checkpoints.remove(block_id)
        self.eviction.discard(("checkpoint", block_id))
        for moved in self.links.remove(block_id):
            self.eviction.update_value(("checkpoint", moved), self._checkpoint_value(moved))
        if self.pool.is_evictable(block_id):
            self.eviction.add_candidate(("kv", block_id), self._kv_value(block_id))

    def clear(self) -> None:
        """Drop every stored entry (pinned ones too: call between requests)."""
        self.pool.clear()
        self.kv.clear()
        self.checkpoints.clear()
        self.eviction.clear()
        self.links.clear()

    def _put_checkpoint(self, block_id: int, states: dict[int, LayerState]) -> None:
        self.checkpoints.put(block_id, states)
        self.eviction.remove_candidate(("kv", block_id))
        for moved in self.links.add(self.pool, block_id):
            self.eviction.update_value(("checkpoint", moved), self._checkpoint_value(moved))
        self.eviction.add_candidate(("checkpoint", block_id), self._checkpoint_value(block_id))

    def _on_evictable(self, block_id: int, evictable: bool) -> None:
        """The pool's report: a KV block without a checkpoint is a candidate exactly while it is evictable."""
        if block_id in self.checkpoints:
            return
        if evictable:
            self.eviction.add_candidate(("kv", block_id), self._kv_value(block_id))
        else:
            self.eviction.remove_candidate(("kv", block_id))

    def _kv_value(self, block_id: int) -> EntryValue:
        """A candidate KV block is a leaf without a checkpoint: it serves no hit, so its span is empty."""
        end_tokens = self.end_tokens(block_id)
        return end_tokens, end_tokens, self.spec.kv_block_bytes

    def _checkpoint_value(self, block_id: int) -> EntryValue:
        """A hit recomputes ``[previous checkpoint, end)`` without this checkpoint."""
        previous = self.links.previous(block_id)
        start_tokens = 0 if previous is None else self.end_tokens(previous)
        return start_tokens, self.end_tokens(block_id), self.checkpoints.checkpoint_bytes(block_id)

    # ------------------------------------------------------------------ inspection

    def end_tokens(self, block_id: int) -> int:
        """The block boundary (in tokens) a stored block ends at."""
        return self.pool[block_id].end_blocks * self.block_size

    def stored_ids(self) -> tuple[set[int], set[int], set[int]]:
        """Block ids known to the block pool, to the KV store and to the checkpoint store (a consistency check)."""
        return set(self.pool.block_ids()), set(self.kv.block_ids()), set(self.checkpoints.block_ids())

    def candidates(self) -> list[EntryKey]:
        """What may be evicted now, the next victim first."""
        return self.eviction.candidates()
