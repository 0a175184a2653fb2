"""The measured transfer model of the read path: one round trip costs ``latency_s + num_bytes / bytes_per_s``.

Both terms are exponential moving averages over this process's successful reads: ``EXISTS`` pipelines (a few bytes)
measure the latency, ``GET`` pipelines the bandwidth after that latency is taken off. Until both are measured the
model has no opinion, and the fetch rule fetches (which measures them).
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


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
