"""Eviction policies: which stored entry goes next, in O(log n) per change and per victim.

The store tells a policy which entries are *candidates* as that changes: every stored checkpoint, and every KV block
that is an unreferenced leaf without a checkpoint of its own (:class:`~hf_hybridcache.store.block_pool.BlockPool`
reports its leaves as they come and go). So a KV block goes only after the blocks that extend it and after its own
checkpoint, a block of the running request never goes, and a checkpoint may go while its KV stays (hits then back off
to an earlier checkpoint). The candidates sit in a sorted list keyed by ``(priority, last used)``, re-keyed only when
an entry is touched or its value changes, so the victim is the first item.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from sortedcontainers import SortedList

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


class EvictionPolicy:
    """Recency (a logical clock stamped on an entry each time it is used) and the ranked candidates.

    Chains are touched leaf first, so a parent is always more recent than the blocks that extend it. A candidate is
    ranked once it has been used (stamped); subclasses say how a value weighs (:meth:`weight`) and how weight and
    recency combine (:meth:`priority`, lowest goes first; ties go to the least recently used).
    """

    name = ""

    def __init__(self) -> None:
        self._clock = 0
        self._last_used: dict[EntryKey, int] = {}
        self._weights: dict[EntryKey, float] = {}  # candidate -> weight of its value
        # (priority, last used, key, weight) of every stamped candidate; (priority, last used) is unique
        self._queue = SortedList()
        self._queued: dict[EntryKey, tuple] = {}

    # ------------------------------------------------------------------ recency

    def touch(self, key: EntryKey) -> None:
        self._clock += 1
        self._last_used[key] = self._clock
        if key in self._weights:
            self._enqueue(key)

    def touch_chain(self, block_ids: Iterable[int]) -> None:
        """Mark a chain (root first) as just used, leaf first so that parents end up the most recent."""
        for block_id in reversed(list(block_ids)):
            self.touch(("kv", block_id))

    def last_used(self, key: EntryKey) -> int:
        return self._last_used[key]

    def oldest_first(self) -> list[EntryKey]:
        """Every entry from least to most recently used (what :mod:`~hf_hybridcache.core.persistence` saves)."""
        return sorted(self._last_used, key=self._last_used.__getitem__)

    # ------------------------------------------------------------------ candidates

    def add_candidate(self, key: EntryKey, value: EntryValue) -> None:
        """``key`` may be evicted from now on; ``value`` is what it saves (see :data:`EntryValue`)."""
        self._weights[key] = self.weight(value)
        if key in self._last_used:
            self._enqueue(key)

    def update_value(self, key: EntryKey, value: EntryValue) -> None:
        """A candidate's value changed (its previous checkpoint came or went); no-op for other entries."""
        if key in self._weights:
            self.add_candidate(key, value)

    def remove_candidate(self, key: EntryKey) -> None:
        """``key`` may not be evicted until it is a candidate again (it stays stored and keeps its recency)."""
        if self._weights.pop(key, None) is not None:
            self._dequeue(key)

    def discard(self, key: EntryKey) -> None:
        """``key`` is no longer stored."""
        self.remove_candidate(key)
        self._last_used.pop(key, None)

    def candidates(self) -> list[EntryKey]:
        """Every ranked candidate, the next victim first."""
        return [entry[2] for entry in self._queue]

    def victim(self) -> EntryKey | None:
        """The candidate to evict next, or None when there is none."""
        return self._queue[0][2] if self._queue else None

    def clear(self) -> None:
        self._last_used.clear()
        self._weights.clear()
        self._queue.clear()
        self._queued.clear()

    # ------------------------------------------------------------------ ranking

    def weight(self, value: EntryValue) -> float:
        return 0.0

    def priority(self, last_used: int, weight: float) -> float:
        return float(last_used)

    def _enqueue(self, key: EntryKey) -> None:
        self._dequeue(key)
        stamp, weight = self._last_used[key], self._weights[key]
        entry = (self.priority(stamp, weight), stamp, key, weight)
        self._queue.add(entry)
        self._queued[key] = entry

    def _dequeue(self, key: EntryKey) -> None:
        entry = self._queued.pop(key, None)
        if entry is not None:
            self._queue.remove(entry)


class LRUEviction(EvictionPolicy):
    """Evict the least recently used candidate (SGLang's and vLLM's order, leaves first)."""

    name = "lru"


class FlopAwareEviction(EvictionPolicy):
    """Evict the candidate with the lowest ``recency + alpha * FLOP efficiency``, each scaled by its spread over the
    candidates (Marconi, MLSys 2025: utility = recency + alpha * FLOPs saved per byte, both min-max normalized).

    FLOP efficiency is the prefill FLOPs a hit would have to recompute without the entry, per byte it holds: for a
    checkpoint at ``n`` tokens, the FLOPs of ``[m, n)`` where ``m`` is the nearest checkpoint before it on its path
    (the hit backs off there; Marconi also counts savings relative to the parent state); for a KV candidate, zero —
    it is a leaf without a checkpoint, so no hit can use it. Recency is the entry's logical timestamp ``t``.

    Marconi's score ``(t - t_min) / t_span + alpha * (e - e_min) / e_span`` ranks candidates as ``t + K * e`` with
    ``K = alpha * t_span / e_span``, but ``K`` moves with every eviction, so ranking it exactly re-scores every
    candidate per victim. Here ``K`` is held fixed between re-measurements, which makes the priority of an entry a
    number set when it is touched or its value changes — the form of GreedyDual-Size (Cao & Irani, USITS 1997), where
    a cost-per-size priority is fixed at access time and the queue is a priority queue. ``K`` is re-measured before a
    victim is picked once ``1 / rekey_every`` of the candidates changed since the last re-keying, and when it moved
    every priority is re-keyed: O(n log n) per n / ``rekey_every`` changes, so O(log n) amortized per change. (A 10%
    drift tolerance on top cost up to 0.06 in token hit rate with dense retention on ``benchmarks/hit_rate.py``;
    re-measuring every 1/32 stays within 0.01 of exact Marconi ranking there.)

    Args:
        flop_model: prefill FLOPs of the model.
        alpha: weight of FLOP efficiency; 0 is recency alone.
        rekey_every: ``K`` is re-measured after ``len(candidates) // rekey_every`` changes (and at the first victim).
    """

    name = "flop_aware"

    def __init__(
        self, flop_model: FlopModel, alpha: float = DEFAULT_FLOP_ALPHA, rekey_every: int = 32
    ) -> None:
        super().__init__()
        self.flop_model = flop_model
        self.rekey_every = rekey_every
        self._alpha = alpha
        self._scale: float | None = None  # K of the priorities in the queue; None: not measured yet
        self._changes = 0  # queue changes since the last re-keying
        self._stamps = SortedList()  # last used of every queued candidate
        self._efficiencies = SortedList()  # weight of every queued candidate

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = value
        self._scale = None  # re-key at the next victim

    def weight(self, value: EntryValue) -> float:
        start, end, num_bytes = value
        return self.flop_model.span_flops(start, end) / num_bytes if end > start else 0.0

    def priority(self, last_used: int, weight: float) -> float:
        return last_used + (self._scale or 0.0) * weight

    def measured_scale(self) -> float:
        """``K = alpha * t_span / e_span`` over the ranked candidates now (spans of 0 count as 1, as Marconi's
        normalization divides by them)."""
        if not self._stamps:
            return self._alpha
        t_span = (self._stamps[-1] - self._stamps[0]) or 1
        e_span = (self._efficiencies[-1] - self._efficiencies[0]) or 1.0
        return self._alpha * t_span / e_span

    def victim(self) -> EntryKey | None:
        if self._queue and (self._scale is None or self._changes >= len(self._queue) // self.rekey_every):
            scale = self.measured_scale()
            if scale != self._scale:
                self._rekey(scale)
            self._changes = 0
        return super().victim()

    def clear(self) -> None:
        super().clear()
        self._stamps.clear()
        self._efficiencies.clear()
        self._scale = None
        self._changes = 0

    def _rekey(self, scale: float) -> None:
        self._scale = scale
        self._changes = 0
        entries = [(self.priority(stamp, weight), stamp, key, weight) for _, stamp, key, weight in self._queue]
        self._queued = {entry[2]: entry for entry in entries}
        self._queue = SortedList(entries)

    def _enqueue(self, key: EntryKey) -> None:
        super()._enqueue(key)
        self._stamps.add(self._last_used[key])
        self._efficiencies.add(self._weights[key])
        self._changes += 1

    def _dequeue(self, key: EntryKey) -> None:
        entry = self._queued.get(key)
        if entry is not None:
            self._stamps.remove(entry[1])
            self._efficiencies.remove(entry[3])  # the weight it was queued with (a value update changes it first)
            self._changes += 1
        super()._dequeue(key)


def make_eviction(name: str, flop_model: FlopModel) -> EvictionPolicy:
    """The policy called ``name`` (one of :data:`EVICTION_POLICIES`)."""
    return LRUEviction() if name == "lru" else FlopAwareEviction(flop_model)
