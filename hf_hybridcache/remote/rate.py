"""The two measured rates the read path weighs against each other (:func:`~hf_hybridcache.remote.fetch.worth_fetching`).

- :class:`TransferRate`: one round trip to the tier costs ``latency_s + num_bytes / bytes_per_s``. Both terms are
  exponential moving averages over this process's successful reads: ``EXISTS`` pipelines (a few bytes) measure the
  latency, ``GET`` pipelines the bandwidth after that latency is taken off.
- :class:`ComputeRate`: the prefill FLOP/s this process sustains, from the cache's own multi-token forwards (their
  FLOPs by the FLOP model over their wall time, the accelerator synchronized at the end).

Until a rate is measured it has no opinion, and the fetch rule fetches (which measures the transfer rate).
"""

from __future__ import annotations

#: Weight of the newest sample in the moving averages.
SMOOTHING = 0.2


class TransferRate:
    """Latency and bandwidth of reads from the tier, measured.

    Attributes:
        latency_s: seconds of a round trip carrying almost nothing (None until measured).
        bytes_per_s: bytes per second beyond the latency (None until measured).
    """

    def __init__(self) -> None:
        self.latency_s: float | None = None
        self.bytes_per_s: float | None = None

    def observe_round_trip(self, seconds: float) -> None:
        self.latency_s = _average(self.latency_s, seconds)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if self.latency_s is None or num_bytes <= 0:
            return
        rate = num_bytes / max(seconds - self.latency_s, seconds * 0.1, 1e-9)
        self.bytes_per_s = _average(self.bytes_per_s, rate)

    def seconds(self, num_bytes: int) -> float | None:
        """Estimated seconds to fetch ``num_bytes`` in one round trip; None until latency and bandwidth are known."""
        if self.latency_s is None or self.bytes_per_s is None:
            return None
        return self.latency_s + num_bytes / self.bytes_per_s


class ComputeRate:
    """Prefill FLOP/s of this process, measured on the cache's own forwards.

    Only forwards of at least ``min_tokens`` tokens count: shorter ones are dominated by per-call overhead.

    Attributes:
        flops_per_s: moving average of the forwards' FLOPs per second (None until one is measured).
    """

    def __init__(self, min_tokens: int = 16) -> None:
        self.min_tokens = min_tokens
        self.flops_per_s: float | None = None

    def observe(self, num_tokens: int, flops: float, seconds: float) -> None:
        """A forward of ``num_tokens`` tokens that cost ``flops`` (FLOP model) took ``seconds`` of wall time."""
        if num_tokens >= self.min_tokens and seconds > 0 and flops > 0:
            self.flops_per_s = _average(self.flops_per_s, flops / seconds)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
