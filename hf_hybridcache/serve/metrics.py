"""The server's Prometheus metrics (``/metrics``, text format, with ``prometheus_client``): its own counters and
histograms, and at each scrape the engine's load and the cache's :class:`~hf_hybridcache.PrefixCacheStats`."""

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
        backend: has ``load() -> (running, waiting)``.
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
        if self.cache is None:
            return
        stats = self.cache.stats
        for name in CACHE_GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_cache_{name}", f"PrefixCacheStats.{name} now.",
                                    value=getattr(stats, name))
        for name in CACHE_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_cache_{name}", f"PrefixCacheStats.{name} so far.",
                                      value=getattr(stats, name))
