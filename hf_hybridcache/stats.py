"""Counters of a :class:`~hf_hybridcache.HybridPrefixCache`, as a frozen snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field


#: Counters of images (:mod:`~hf_hybridcache.generate.images`), kept beside the others once a request had images.
_IMAGE_COUNTERS = ("images_encoded", "images_skipped", "vision_encoder_calls", "vision_encoder_seconds")


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of a :class:`HybridPrefixCache` (a snapshot; token counts are summed over requests and rows).

    Attributes:
        requests: ``generate()`` calls (prefills) served.
        prompt_tokens: prompt tokens seen.
        hit_tokens: prompt tokens restored from the cache instead of computed.
        computed_prompt_tokens: prompt tokens run through the model (``prompt_tokens - hit_tokens``).
        kv_blocks: KV blocks stored now.
        checkpoints: checkpoints stored now.
        stored_bytes: bytes of stored KV blocks + checkpoints now (``kv_bytes + checkpoint_bytes``).
        kv_bytes: bytes of the stored KV blocks now.
        checkpoint_bytes: bytes of the stored checkpoints now.
        max_cache_bytes: the budget ``stored_bytes`` never exceeds.
        evicted_kv_blocks: KV blocks evicted so far.
        evicted_checkpoints: checkpoints evicted so far.
        divergence_checkpoints: checkpoints admitted at divergence points so far.
        replayed_reply_tokens: reply tokens run again as one prefill after ``generate()`` produced them, to store
            them as a prefill computes them (``replay_replies``).
        remote_hit_tokens: hit tokens restored from entries fetched from the remote tier (part of ``hit_tokens``).
        remote_bytes_read, remote_bytes_written: bytes of entries read from / written to the tier.
        remote_round_trips: pipelines sent to the tier (each is one round trip on a standalone server).
        remote_errors: tier operations that failed (timeouts, refused connections); the requests ran on.
        remote_dropped_writes: entries not published (the writer's queue was full, or the tier failed or was
            skipped by its circuit breaker).
        remote_corrupt_entries: entries read from the tier that did not verify (served as misses): damaged,
            tampered or foreign, or, under ``RemoteConfig(secret=...)``, unsigned or signed under another secret.
        remote_removed_entries: such entries this process removed from the tier, so that the next process that
            computes them writes them again (:mod:`~hf_hybridcache.remote.writer`).
        remote_recomputed_tokens: tokens the tier held beyond the local hit but left there, recomputing them being
            measured as faster than fetching them (:func:`~hf_hybridcache.remote.fetch.worth_fetching`). The
            ``remote_*`` counters stay 0 without ``remote=``.
        images_encoded, images_skipped: images (videos, tiles) of vision-language prompts run through the vision
            tower, and those a hit held and the tower never saw (:mod:`~hf_hybridcache.generate.images`).
        vision_encoder_calls, vision_encoder_seconds: calls of a wrapper's feature method for them, and their time.
        misses_by_reason: ``{reason: rows}`` over every :data:`~hf_hybridcache.core.explain.REASONS` (0 when none): why
            each prompt row looked up so far hit what it hit (:class:`~hf_hybridcache.core.explain.HitReport`). A full
            hit counts as ``"complete"``, so the values add up to the rows served (``requests`` for single-row calls);
            every other reason is a miss or a short hit.
    """

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    kv_blocks: int = 0
    checkpoints: int = 0
    stored_bytes: int = 0
    kv_bytes: int = 0
    checkpoint_bytes: int = 0
    max_cache_bytes: int = 0
    evicted_kv_blocks: int = 0
    evicted_checkpoints: int = 0
    divergence_checkpoints: int = 0
    replayed_reply_tokens: int = 0
    remote_hit_tokens: int = 0
    remote_bytes_read: int = 0
    remote_bytes_written: int = 0
    remote_round_trips: int = 0
    remote_errors: int = 0
    remote_dropped_writes: int = 0
    remote_corrupt_entries: int = 0
    remote_removed_entries: int = 0
    remote_recomputed_tokens: int = 0
    images_encoded: int = 0
    images_skipped: int = 0
    vision_encoder_calls: int = 0
    vision_encoder_seconds: float = 0.0
    misses_by_reason: dict[str, int] = field(default_factory=dict)

    @classmethod
    def snapshot(
        cls,
        counters: dict[str, int],
        store,
        remote: dict[str, int] | None = None,
        reasons: dict[str, int] | None = None,
    ) -> PrefixCacheStats:
        """The counters of past requests plus what ``store`` (a :class:`~hf_hybridcache.store.PrefixStore`) holds,
        the remote tier's counters (``{"remote_*": int}``, None without a tier) and the rows counted per reason."""
        return cls(
            requests=counters["requests"],
            prompt_tokens=counters["prompt_tokens"],
            hit_tokens=counters["hit_tokens"],
            computed_prompt_tokens=counters["prompt_tokens"] - counters["hit_tokens"],
            kv_blocks=store.num_kv_blocks,
            checkpoints=store.num_checkpoints,
            stored_bytes=store.stored_bytes,
            kv_bytes=store.kv_bytes,
            checkpoint_bytes=store.checkpoint_bytes,
            max_cache_bytes=store.max_cache_bytes,
            evicted_kv_blocks=store.evicted_kv_blocks,
            evicted_checkpoints=store.evicted_checkpoints,
            divergence_checkpoints=counters["divergence_checkpoints"],
            replayed_reply_tokens=counters["replayed_reply_tokens"],
            **{name: counters.get(name, 0) for name in _IMAGE_COUNTERS},
            misses_by_reason=dict(reasons or {}),
            **(remote or {}),
        )

    @property
    def token_hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0.0 before any request)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
