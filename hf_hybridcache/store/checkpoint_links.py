"""Which checkpoint a hit backs off to: for every stored checkpoint, the nearest checkpoint above it on its path,
and the reverse index, so adding or dropping a checkpoint finds exactly the checkpoints whose previous one changes
(the FLOP-aware policy values a checkpoint by the tokens between it and its previous one). No tensors."""

from __future__ import annotations

from .block_pool import BlockPool


class CheckpointLinks:
    """``previous[c]``: the nearest checkpointed block above checkpoint ``c`` (None: none, a hit without ``c`` misses);
    ``following[p]``: the checkpoints whose previous one is ``p``."""

    def __init__(self) -> None:
        self._previous: dict[int, int | None] = {}
        self._following: dict[int | None, set[int]] = {}

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._previous

    def previous(self, block_id: int) -> int | None:
        return self._previous[block_id]

    def add(self, pool: BlockPool, block_id: int) -> list[int]:
        """Link a new checkpoint at ``block_id``; returns the checkpoints whose previous one is now ``block_id``:
        those below it with no checkpoint in between, found by walking its subtree down to the next checkpoints (the
        walk visits only blocks whose nearest checkpoint above changes)."""
        assert block_id not in self._previous, "checkpoint linked twice"
        previous = pool[block_id].parent_id
        while previous is not None and previous not in self._previous:
            previous = pool[previous].parent_id
        self._previous[block_id] = previous
        self._following.setdefault(previous, set()).add(block_id)
        moved, stack = [], list(pool[block_id].children)
        while stack:
            child = stack.pop()
            if child in self._previous:
                moved.append(child)
            else:
                stack.extend(pool[child].children)
        for child in moved:
            self._following[previous].discard(child)
            self._previous[child] = block_id
        if moved:
            self._following[block_id] = set(moved)
        return moved

    def remove(self, block_id: int) -> list[int]:
        """Unlink the checkpoint at ``block_id``; returns the checkpoints whose previous one changed (to its own)."""
        previous = self._previous.pop(block_id)
        self._following[previous].discard(block_id)
        moved = self._following.pop(block_id, set())
        for child in moved:
            self._previous[child] = previous
        self._following.setdefault(previous, set()).update(moved)
        return list(moved)

    def clear(self) -> None:
        self._previous.clear()
        self._following.clear()
