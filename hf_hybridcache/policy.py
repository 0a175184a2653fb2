"""What to keep: the checkpoint retention plan, and least-recently-used eviction over KV blocks and checkpoints."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Literal

EntryKind = Literal["kv", "checkpoint"]
EntryKey = tuple[EntryKind, int]


def retained_boundaries(
    start: int, end: int, prompt_tokens: int, block_size: int, retention_tokens: int
) -> list[int]:
    """Block boundaries in ``(start, end]`` whose checkpoint is kept for good.

    These are the multiples of the retention interval (none when ``retention_tokens == 0``) and the mandatory
    prompt-end boundaries: the last boundary ``<= prompt_tokens`` and the last boundary ``< prompt_tokens``, so that an
    identical prompt re-run replays at most one block (vLLM keeps the prompt-end checkpoint under sparse retention
    for the same reason).
    """
    kept = {(prompt_tokens // block_size) * block_size, ((prompt_tokens - 1) // block_size) * block_size}
    if retention_tokens:
        first = (start // retention_tokens + 1) * retention_tokens
        kept.update(range(first, end + 1, retention_tokens))
    return sorted(b for b in kept if start < b <= end and b > 0)


def last_boundary(end: int, block_size: int) -> int:
    """The last block boundary at or below ``end`` tokens."""
    return (end // block_size) * block_size


class LRUEviction:
    """Recency order over stored entries, oldest first.

    Chains are touched leaf first, so a parent is always more recent than the blocks that extend it and the oldest
    unreferenced KV entry is a leaf: evicting from the front never orphans a chain (plain LRU over blocks would evict
    a chain's first block first).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[EntryKey, None] = OrderedDict()

    def touch(self, key: EntryKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch_chain(self, block_ids: Iterable[int]) -> None:
        """Mark a chain (root first) as just used, leaf first so that parents end up the most recent."""
        for block_id in reversed(list(block_ids)):
            self.touch(("kv", block_id))

    def discard(self, key: EntryKey) -> None:
        self._order.pop(key, None)

    def oldest_first(self) -> Iterator[EntryKey]:
        """Entries from least to most recently used. Do not evict while iterating: pick, stop, then evict."""
        return iter(self._order)

    def clear(self) -> None:
        self._order.clear()
