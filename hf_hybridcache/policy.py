"""What to keep: the checkpoint retention plan, and the eviction policies over stored KV blocks and checkpoints.

Both policies rank the *candidates* the store hands them: every stored checkpoint, and every KV block that is an
unreferenced leaf without a checkpoint of its own. So a KV block goes only after the blocks that extend it and after its
own checkpoint, a block of the running request never goes, and a checkpoint may go while its KV stays (hits then back
off to an earlier checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from .flops import FlopModel

EntryKind = Literal["kv", "checkpoint"]
EntryKey = tuple[EntryKind, int]
#: ``(start_tokens, end_tokens, num_bytes)`` of a candidate: a hit would have to recompute tokens
#: ``[start_tokens, end_tokens)`` without it, and evicting it frees ``num_bytes``.
EntryValue = tuple[int, int, int]

EVICTION_POLICIES = ("lru", "flop_aware")

#: Weight of FLOP efficiency against recency in the ``flop_aware`` score, chosen with ``benchmarks/hit_rate.py``
#: (the README gives the sweep).
DEFAULT_FLOP_ALPHA = 0.75


def retained_boundaries(
    start: int, end: int, prompt_tokens: int, block_size: int, retention_tokens: int, divergence_tokens: int = 0
) -> list[int]:
    """Block boundaries in ``(start, end]`` whose checkpoint is kept for good.

    These are the multiples of the retention interval (none when ``retention_tokens == 0``), the mandatory
    prompt-end boundaries — the last boundary ``<= prompt_tokens`` and the last boundary ``< prompt_tokens``, so that
    an identical prompt re-run replays at most one block (vLLM keeps the prompt-end checkpoint under sparse retention
    for the same reason) — and the divergence point, where the prompt leaves an already stored token path (0: none).
    """
    kept = {(prompt_tokens // block_size) * block_size, ((prompt_tokens - 1) // block_size) * block_size}
    if divergence_tokens:
        kept.add(divergence_tokens)
    if retention_tokens:
        first = (start // retention_tokens + 1) * retention_tokens
        kept.update(range(first, end + 1, retention_tokens))
    return sorted(b for b in kept if start < b <= end and b > 0)


def last_boundary(end: int, block_size: int) -> int:
    """The last block boundary at or below ``end`` tokens."""
    return (end // block_size) * block_size


class EvictionPolicy:
    """Recency bookkeeping shared by the policies: a logical clock stamped on an entry each time it is used.

    Chains are touched leaf first, so a parent is always more recent than the blocks that extend it.
    """

    name = ""

    def __init__(self) -> None:
        self._clock = 0
        self._last_used: dict[EntryKey, int] = {}

    def touch(self, key: EntryKey) -> None:
        self._clock += 1
        self._last_used[key] = self._clock

    def touch_chain(self, block_ids: Iterable[int]) -> None:
        """Mark a chain (root first) as just used, leaf first so that parents end up the most recent."""
        for block_id in reversed(list(block_ids)):
            self.touch(("kv", block_id))

    def last_used(self, key: EntryKey) -> int:
        return self._last_used[key]

    def oldest_first(self) -> list[EntryKey]:
        """Every entry from least to most recently used (what :mod:`~hf_hybridcache.persistence` saves)."""
        return sorted(self._last_used, key=self._last_used.__getitem__)

    def discard(self, key: EntryKey) -> None:
        self._last_used.pop(key, None)

    def clear(self) -> None:
        self._last_used.clear()

    def victim(self, candidates: Sequence[EntryKey], value: Callable[[EntryKey], EntryValue]) -> EntryKey:
        """The candidate to evict next (``candidates`` is not empty)."""
        raise NotImplementedError


class LRUEviction(EvictionPolicy):
    """Evict the least recently used candidate (SGLang's and vLLM's order, leaves first)."""

    name = "lru"

    def victim(self, candidates: Sequence[EntryKey], value: Callable[[EntryKey], EntryValue]) -> EntryKey:
        return min(candidates, key=self._last_used.__getitem__)


class FlopAwareEviction(EvictionPolicy):
    """Evict the candidate with the lowest ``recency + alpha * FLOP efficiency``, both min-max normalized to [0, 1]
    over the candidates (Marconi, MLSys 2025: utility = recency + alpha * FLOPs saved per byte).

    FLOP efficiency is the prefill FLOPs a hit would have to recompute without the entry, per byte it holds: for a
    checkpoint at ``n`` tokens, the FLOPs of ``[m, n)`` where ``m`` is the nearest checkpoint before it on its path
    (the hit backs off there; Marconi also counts savings relative to the parent state); for a KV candidate, zero —
    it is a leaf without a checkpoint, so no hit can use it. Recency is the entry's logical timestamp. Ties go to the
    least recently used candidate.

    Args:
        flop_model: prefill FLOPs of the model.
        alpha: weight of FLOP efficiency; 0 is recency alone.
    """

    name = "flop_aware"

    def __init__(self, flop_model: FlopModel, alpha: float = DEFAULT_FLOP_ALPHA) -> None:
        super().__init__()
        self.flop_model = flop_model
        self.alpha = alpha

    def efficiency(self, value: EntryValue) -> float:
        start, end, num_bytes = value
        return self.flop_model.span_flops(start, end) / num_bytes if end > start else 0.0

    def victim(self, candidates: Sequence[EntryKey], value: Callable[[EntryKey], EntryValue]) -> EntryKey:
        stamps = [self._last_used[key] for key in candidates]
        effs = [self.efficiency(value(key)) for key in candidates]
        t_min, t_span = min(stamps), (max(stamps) - min(stamps)) or 1
        e_min, e_span = min(effs), (max(effs) - min(effs)) or 1.0
        scores = [
            ((t - t_min) / t_span + self.alpha * (e - e_min) / e_span, t) for t, e in zip(stamps, effs)
        ]
        return candidates[min(range(len(candidates)), key=scores.__getitem__)]


def make_eviction(name: str, flop_model: FlopModel) -> EvictionPolicy:
    """The policy called ``name`` (one of :data:`EVICTION_POLICIES`)."""
    return LRUEviction() if name == "lru" else FlopAwareEviction(flop_model)
