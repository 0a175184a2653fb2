"""What a miss is explained from besides the store itself: the entries the budget evicted and the weights states
before the current one, each kept in a bounded record (:mod:`~hf_hybridcache.core.explain` reads them)."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from ..hashing import BlockHash

#: Evictions remembered, the oldest forgotten first (about 250 bytes each: 1 MiB at most).
EVICTIONS_KEPT = 4096
#: Weights states remembered before the current one.
WEIGHTS_STATES_KEPT = 4
#: Roots whose salt is remembered (one per tenant view in use), the least recently used forgotten first.
ROOTS_KEPT = 1024


@dataclass(frozen=True)
class Eviction:
    """One stored entry the budget evicted.

    Attributes:
        boundary_tokens: the block boundary the entry ends at.
        request: requests counted when it was evicted (the request during which it went, or the last one before).
        budget_lowered: it went because ``max_cache_bytes`` was lowered, not to make room for a new entry.
    """

    boundary_tokens: int
    request: int
    budget_lowered: bool = False


class EvictionLog:
    """The last :data:`EVICTIONS_KEPT` evictions, by ``(kind, block hash)`` (``kind`` is ``"kv"`` or
    ``"checkpoint"``); an entry stored again and then dropped for another reason is forgotten."""

    def __init__(self, max_entries: int = EVICTIONS_KEPT) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, BlockHash], Eviction] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, kind: str, block_hash: BlockHash, eviction: Eviction) -> None:
        key = (kind, block_hash)
        self._entries.pop(key, None)
        self._entries[key] = eviction
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, kind: str, block_hash: BlockHash) -> None:
        self._entries.pop((kind, block_hash), None)

    def get(self, kind: str, block_hash: BlockHash) -> Eviction | None:
        return self._entries.get((kind, block_hash))

    def clear(self) -> None:
        self._entries.clear()


class WeightsHistory:
    """The last :data:`WEIGHTS_STATES_KEPT` weights states before the current one (fingerprints, most recent first)
    and the salt of the last :data:`ROOTS_KEPT` roots requests were given, so that the roots a request would have had
    under earlier weights can be made again."""

    def __init__(self, max_states: int = WEIGHTS_STATES_KEPT, max_roots: int = ROOTS_KEPT) -> None:
        self.previous: deque[str] = deque(maxlen=max_states)
        self.max_roots = max_roots
        self._salts: OrderedDict[BlockHash, str | None] = OrderedDict()

    def weights_changed(self, old_fingerprint: str) -> None:
        """The weights state ``old_fingerprint`` was just replaced."""
        if old_fingerprint in self.previous:
            self.previous.remove(old_fingerprint)
        self.previous.appendleft(old_fingerprint)

    def saw_root(self, root: BlockHash, salt: str | None) -> None:
        self._salts[root] = salt
        self._salts.move_to_end(root)
        if len(self._salts) > self.max_roots:
            self._salts.popitem(last=False)

    def salt_of(self, root: BlockHash) -> tuple[bool, str | None]:
        """``(known, salt)`` of a root a request was given."""
        return root in self._salts, self._salts.get(root)
