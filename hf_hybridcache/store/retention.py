"""What to keep: the block boundaries whose checkpoints a request stores for good.

:func:`plan_checkpoints` is the one place that chooses them for a forward of a request, so that ``generate()``
(:class:`~hf_hybridcache.generate.live.LiveRequest`, its reply replay) and the serving engine (``engine/storing.py``,
its reply replays) keep the same checkpoints and a prompt re-sent to either hits the same depth.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import CacheOptions


def retained_boundaries(
    start: int,
    end: int,
    prompt_tokens: int,
    block_size: int,
    retention_tokens: int,
    divergence_tokens: int,
    tail_tokens: int,
) -> list[int]:
    """Block boundaries in ``(start, end]`` whose checkpoint is kept for good.

    These are the multiples of the retention interval (none when ``retention_tokens == 0``), the mandatory
    prompt-end boundaries — the last boundary ``<= prompt_tokens`` and the last boundary ``<= prompt_tokens -
    tail_tokens`` (the deepest hit a lookup of the same prompt may return), so that an identical prompt re-run
    replays at most one block plus ``tail_tokens - 1`` (vLLM keeps the prompt-end checkpoint under sparse retention
    for the same reason) — and the divergence point, where the prompt leaves an already stored token path (0: none).
    ``tail_tokens`` (the options' ``min_tail_tokens``: 2 with ``replay_replies``) has no default: a caller that left
    it out kept the checkpoint a re-sent 33-token prompt hits at 32 instead of 16, and the re-run missed.
    """
    kept = {(prompt_tokens // block_size) * block_size, ((prompt_tokens - tail_tokens) // block_size) * block_size}
    if divergence_tokens:
        kept.add(divergence_tokens)
    if retention_tokens:
        first = (start // retention_tokens + 1) * retention_tokens
        kept.update(range(first, end + 1, retention_tokens))
    return sorted(b for b in kept if start < b <= end and b > 0)


@dataclass(frozen=True)
class CheckpointPlan:
    """The checkpoints one forward over a request's tokens ``(start, end]`` stores.

    Attributes:
        kept: boundaries whose checkpoints are kept for good: :func:`retained_boundaries` under the options (its
            tail included), the divergence point and the extra boundaries asked for.
        wanted: ``kept`` and the last boundary reached (kept until a later one replaces it: the decode-end
            checkpoint): the boundaries whose states the forward hands over.
        admitted_divergence: the divergence point when it is kept only because it is one (retention and the prompt
            end would not keep it: a divergence admission to count), else 0.
    """

    kept: frozenset[int]
    wanted: frozenset[int]
    admitted_divergence: int


def plan_checkpoints(
    start: int,
    end: int,
    prompt_tokens: int,
    options: CacheOptions,
    divergence_tokens: int = 0,
    extra_boundaries: Iterable[int] = (),
) -> CheckpointPlan:
    """What a forward over tokens ``(start, end]`` of a request with a ``prompt_tokens``-token prompt keeps, under
    ``options`` (block size, retention interval, ``min_tail_tokens``); ``divergence_tokens`` is where its prompt
    left a stored path (0: none), ``extra_boundaries`` are kept too (the engine: other requests sharing its prefix
    asked for them)."""
    block_size = options.block_size
    plain = frozenset(retained_boundaries(start, end, prompt_tokens, block_size, options.retention_tokens, 0,
                                          options.min_tail_tokens))
    kept = plain | {b for b in (divergence_tokens, *extra_boundaries) if b > 0 and start < b <= end}
    reached = last_boundary(end, block_size)
    wanted = kept | {reached} if start < reached else kept
    admitted = divergence_tokens if divergence_tokens in kept and divergence_tokens not in plain else 0
    return CheckpointPlan(kept, wanted, admitted)


def last_boundary(end: int, block_size: int) -> int:
    """The last block boundary at or below ``end`` tokens."""
    return (end // block_size) * block_size
