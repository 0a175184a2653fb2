"""The server's Prometheus metrics (``/metrics``, text format, with ``prometheus_client``): its own counters and
histograms, and at each scrape the engine's load, the cache's :class:`~hf_hybridcache.PrefixCacheStats` and, with
``--speculative``, the engine's :class:`~hf_hybridcache.engine.SpeculationStats` (drafted and accepted tokens, in all
and by draft position, and the acceptance rate by position, as vLLM's ``spec_decode`` metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "hf_hybridcache"

#: Seconds; TTFT on a CPU toy model is milliseconds, on a real model up to seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: Cache counters exported as ``hf_hybridcache_cache_<name>_total``; the remote tier's are its tier counters.
CACHE_COUNTERS = (
    "evicted_kv_blocks", "evicted_checkpoints", "divergence_checkpoints", "replayed_reply_tokens", "remote_hit_tokens",
    "remote_bytes_read", "remote_bytes_written", "remote_round_trips", "remote_errors", "remote_dropped_writes",
    "remote_corrupt_entries", "remote_removed_entries", "remote_recomputed_tokens",
    "images_encoded", "images_skipped", "vision_encoder_calls", "vision_encoder_seconds",  # a vision-language wrapper
)
CACHE_GAUGES = ("stored_bytes", "kv_bytes", "checkpoint_bytes", "max_cache_bytes", "kv_blocks", "checkpoints")


class ServerMetrics:
    """One registry per server (so several servers can live in one process, as in tests).

    Args:
        backend: has ``load() -> (running, waiting)``, ``speculation_stats()`` (None: no speculation) and
            ``num_speculative_tokens`` (the draft positions reported).
        cache: the :class:`~hf_hybridcache.HybridPrefixCache`, or None (the stock baseline).
    """

    def __init__(self, backend, cache=None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of generation requests.",
                                     registry=self.registry)
        self.hit_tokens = Counter(f"{PREFIX}_hit_tokens", "Prompt tokens restored from the prefix cache.",
                                  registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.token_latency = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Time between a request's tokens.",
                                       buckets=TOKEN_BUCKETS, registry=self.registry)
        self.registry.register(_LiveCollector(backend, cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """Read at scrape time: running and waiting requests, stored bytes, evictions, tier counters."""

    def __init__(self, backend, cache) -> None:
        self.backend, self.cache = backend, cache

    def describe(self):
        return []

    def collect(self):
        running, waiting = self.backend.load()
        yield GaugeMetricFamily(f"{PREFIX}_running_requests", "Requests being generated now.", value=running)
        yield GaugeMetricFamily(f"{PREFIX}_waiting_requests", "Requests queued for admission now.", value=waiting)
        yield from _speculation(self.backend.speculation_stats(), self.backend.num_speculative_tokens)
        if self.cache is None:
            return
        stats = self.cache.stats
        for name in CACHE_GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_cache_{name}", f"PrefixCacheStats.{name} now.",
                                    value=getattr(stats, name))
        for name in CACHE_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_cache_{name}", f"PrefixCacheStats.{name} so far.",
                                      value=getattr(stats, name))


def _speculation(stats, num_positions: int):
    """``hf_hybridcache_spec_decode_*``: verify steps, drafted, accepted and emitted tokens, the same by draft position
    (label ``position``, 0 first) and the acceptance rate by position (nan before a draft had a token there)."""
    if stats is None:
        return
    name = f"{PREFIX}_spec_decode"
    for what, value, text in (
            ("verify_steps", stats.verify_segments, "Request-steps that verified a draft."),
            ("draft_tokens", stats.drafted_tokens, "Draft tokens verified."),
            ("accepted_tokens", stats.accepted_tokens, "Draft tokens accepted (kept)."),
            ("emitted_tokens", stats.emitted_tokens, "Tokens verify steps emitted (kept drafts, one more each).")):
        yield CounterMetricFamily(f"{name}_{what}", text, value=value)
    drafted = CounterMetricFamily(f"{name}_draft_tokens_per_position",
                                  "Draft tokens verified at each draft position.", labels=["position"])
    accepted = CounterMetricFamily(f"{name}_accepted_tokens_per_position",
                                   "Draft tokens accepted at each draft position.", labels=["position"])
    rate = GaugeMetricFamily(f"{name}_acceptance_rate_per_position",
                             "Accepted over drafted tokens at each draft position, so far.", labels=["position"])
    for i in range(num_positions):
        d, a = stats.drafted_by_position[i], stats.accepted_by_position[i]
        drafted.add_metric([str(i)], d)
        accepted.add_metric([str(i)], a)
        rate.add_metric([str(i)], a / d if d else float("nan"))
    yield from (drafted, accepted, rate)
