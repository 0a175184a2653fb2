"""What to keep: the block boundaries whose checkpoints a request stores for good."""

from __future__ import annotations


def retained_boundaries(
    start: int,
    end: int,
    prompt_tokens: int,
    block_size: int,
    retention_tokens: int,
    divergence_tokens: int = 0,
    tail_tokens: int = 1,
) -> list[int]:
    """Block boundaries in ``(start, end]`` whose checkpoint is kept for good.

    These are the multiples of the retention interval (none when ``retention_tokens == 0``), the mandatory
    prompt-end boundaries — the last boundary ``<= prompt_tokens`` and the last boundary ``<= prompt_tokens -
    tail_tokens`` (the deepest hit a lookup of the same prompt may return), so that an identical prompt re-run
    replays at most one block plus ``tail_tokens - 1`` (vLLM keeps the prompt-end checkpoint under sparse retention
    for the same reason) — and the divergence point, where the prompt leaves an already stored token path (0: none).
    """
    kept = {(prompt_tokens // block_size) * block_size, ((prompt_tokens - tail_tokens) // block_size) * block_size}
    if divergence_tokens:
        kept.add(divergence_tokens)
    if retention_tokens:
        first = (start // retention_tokens + 1) * retention_tokens
        kept.update(range(first, end + 1, retention_tokens))
    return sorted(b for b in kept if start < b <= end and b > 0)


def last_boundary(end: int, block_size: int) -> int:
    """The last block boundary at or below ``end`` tokens."""
    return (end // block_size) * block_size
