"""The tier's connection: pipelined reads and writes through redis-py, a circuit breaker and the tier's counters.

Every operation is one pipeline (one round trip on a standalone server; redis-py's cluster pipeline splits it per
node), so a request asks the tier at most a few times. Any error — refused connection, timeout, a server that went
away mid-reply — is caught here, counted, and answered as "nothing there"; after ``breaker_errors`` consecutive ones
the breaker opens and operations are skipped without touching the network until ``retry_after_s`` has passed, when
one operation tries again (a half-open breaker, as in Nygard's *Release It!*). So the tier can slow a request by at
most the socket timeouts, and only until the breaker opens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from .rate import TransferRate

logger = logging.getLogger("hf_hybridcache")

#: The tier's counters (see :class:`~hf_hybridcache.stats.PrefixCacheStats`).
COUNTERS = (
    "remote_hit_tokens", "remote_bytes_read", "remote_bytes_written", "remote_round_trips", "remote_errors",
    "remote_dropped_writes", "remote_corrupt_entries", "remote_removed_entries", "remote_recomputed_tokens",
)
#: Round-trip times kept per kind.
LATENCY_SAMPLES = 4096


class CircuitBreaker:
    """Closed until ``max_errors`` consecutive failures, then open for ``retry_after_s``, then half-open: the next
    operation is let through, and its outcome closes or re-opens the breaker. ``clock`` is ``time.monotonic``."""

    def __init__(self, max_errors: int, retry_after_s: float, clock=time.monotonic) -> None:
        self.max_errors = max_errors
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.errors = 0
        self.opened_at: float | None = None
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None and self.clock() - self.opened_at < self.retry_after_s

    @property
    def state(self) -> str:
        """``"closed"`` (the tier is used), ``"open"`` (skipped) or ``"half-open"`` (the next operation tries it)."""
        if self.opened_at is None:
            return "closed"
        return "open" if self.is_open else "half-open"

    def allow(self) -> bool:
        return not self.is_open

    def success(self) -> None:
        if self.opened_at is not None:
            logger.warning("the remote tier answers again; the circuit breaker is closed")
        self.errors, self.opened_at = 0, None

    def failure(self) -> None:
        self.errors += 1
        if self.errors >= self.max_errors:
            if self.opened_at is None:
                self.times_opened += 1
                logger.warning(
                    "the remote tier failed %d times in a row; requests run without it for %.1f s, then it is tried "
                    "again", self.errors, self.retry_after_s,
                )
            self.opened_at = self.clock()


class TierClient:
    """Pipelined GET / EXISTS / SET NX / DEL over a redis-py client, guarded by a :class:`CircuitBreaker`; thread-safe
    (the request thread reads while the background writer writes).

    Attributes:
        counters: ``{name: int}`` for :data:`COUNTERS` (bytes and round trips counted here; hits by the fetcher).
        latencies_s: ``{"read": deque, "write": deque}``, seconds of the latest successful round trips (reads:
            EXISTS and GET pipelines; writes: SET pipelines), for benchmarks and health checks.
        rate: the measured latency and bandwidth of reads (:mod:`~hf_hybridcache.remote.rate`).
    """

    def __init__(self, client, breaker: CircuitBreaker) -> None:
        self.client = client
        self.breaker = breaker
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latencies_s = {"read": deque(maxlen=LATENCY_SAMPLES), "write": deque(maxlen=LATENCY_SAMPLES)}
        self.rate = TransferRate()
        self._lock = threading.Lock()

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def _run(self, queue, kind: str = "read", record: bool = True) -> tuple[list, float] | None:
        """Run ``queue(pipeline)`` as one round trip; its replies and seconds, or None when the breaker is open or it
        failed. ``record=False``: the round trip leaves no trace (counters, latencies, breaker), for a dry run."""
        with self._lock:
            if not self.breaker.allow():
                return None
        try:
            started = time.perf_counter()
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            replies = pipe.execute()
            seconds = time.perf_counter() - started
        except Exception as error:  # redis errors, OSError, timeouts: a tier failure never fails a request
            logger.debug("remote tier operation failed: %s: %s", type(error).__name__, error)
            if record:
                with self._lock:
                    self.counters["remote_round_trips"] += 1
                    self.counters["remote_errors"] += 1
                    self.breaker.failure()
            return None
        if record:
            with self._lock:
                self.counters["remote_round_trips"] += 1
                self.latencies_s[kind].append(seconds)
                self.breaker.success()
        return replies, seconds

    def exists(self, keys: Sequence[str], record: bool = True) -> list[bool] | None:
        """Whether each key is stored (None: the tier did not answer). ``record=False``: no trace, as in
        :meth:`_run`, and the latency is not measured."""
        if not keys:
            return []
        done = self._run(lambda pipe: [pipe.exists(key) for key in keys], record=record)
        if done is None:
            return None
        if record:
            self.rate.observe_round_trip(done[1])
        return [bool(r) for r in done[0]]

    def get(self, keys: Sequence[str]) -> list[bytes | None] | None:
        """The value of each key, None where it is missing (None for all: the tier did not answer)."""
        if not keys:
            return []
        done = self._run(lambda pipe: [pipe.get(key) for key in keys])
        if done is None:
            return None
        replies, seconds = done
        num_bytes = sum(len(r) for r in replies if r is not None)
        self.count("remote_bytes_read", num_bytes)
        self.rate.observe_transfer(num_bytes, seconds)
        return replies

    def write(self, items: Sequence[tuple[str, bytes | None]]) -> bool:
        """In one round trip and in order: store each ``(key, value)`` unless the key exists (entries are immutable:
        the first writer wins), and delete each ``(key, None)`` (a value that failed verification, so that the next
        writer of that key replaces it). False when the tier did not answer."""
        if not items:
            return True

        def queue(pipe) -> None:
            for key, value in items:
                if value is None:
                    pipe.delete(key)
                else:
                    pipe.set(key, value, nx=True)

        done = self._run(queue, "write")
        if done is None:
            return False
        replies = list(zip(items, done[0]))
        self.count("remote_bytes_written", sum(len(value) for (_, value), r in replies if value is not None and r))
        self.count("remote_removed_entries", sum(1 for (_, value), r in replies if value is None and r))
        return True
