"""What a worker's requests saw lately: time to first token and time between tokens.

Each worker keeps two `LatencyWindow`s and puts their 90th percentiles in its load reports
(`ttft_p90_s`, `itl_p90_s`), the planner's observed latencies (services/planner/policy.py).
A window is a histogram of log-spaced buckets per second, over the last `window_s`
seconds: adding a sample and reading a quantile cost a fixed amount of work whatever the
traffic (about 10 us; one per token chunk at most), and nothing grows with load.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque

_SMALLEST_S = 1e-4  # samples below 0.1 ms count as 0.1 ms
_GROWTH = 1.05  # a bucket's upper bound is 5% over its lower: a quantile is that exact
_LAST = 400  # buckets; 1e-4 s * 1.05 ** 400 ~ 30 h: nothing real lies beyond


def _bucket(seconds: float) -> int:
    if seconds <= _SMALLEST_S:
        return 0
    return min(_LAST, 1 + int(math.log(seconds / _SMALLEST_S, _GROWTH)))


def _upper(bucket: int) -> float:
    return _SMALLEST_S * _GROWTH**bucket


class LatencyWindow:
    """Latency samples of the last `window_s` seconds, weighted, for quantiles."""

    def __init__(self, window_s: float = 10.0):
        if window_s < 1:
            raise ValueError("a latency window is at least 1 s")
        self.window_s = window_s
        self._seconds: deque[tuple[int, Counter[int]]] = deque()  # (whole second, buckets)

    def add(self, seconds: float, weight: int = 1, now: float | None = None) -> None:
        """One sample of `seconds` (negative ones are clock noise: 0), counted `weight` times."""
        if weight <= 0:
            return
        second = int(time.monotonic() if now is None else now)
        if not self._seconds or self._seconds[-1][0] != second:
            self._seconds.append((second, Counter()))
            self._forget(second)
        self._seconds[-1][1][_bucket(max(0.0, seconds))] += weight

    def quantile(self, q: float, now: float | None = None) -> float:
        """The `q` quantile (0 < q <= 1) of the window's samples, as the upper bound of
        its bucket (at most 5% above the true value); 0.0 when the window is empty."""
        if not 0 < q <= 1:
            raise ValueError("a quantile is in (0, 1]")
        self._forget(int(time.monotonic() if now is None else now))
        total: Counter[int] = Counter()
        for _, counts in self._seconds:
            total.update(counts)
        n = sum(total.values())
        if n == 0:
            return 0.0
        rank, seen = math.ceil(q * n), 0
        for bucket in sorted(total):
            seen += total[bucket]
            if seen >= rank:
                return _upper(bucket)
        return _upper(max(total))  # not reached: seen ends at n >= rank

    def _forget(self, second: int) -> None:
        while self._seconds and self._seconds[0][0] <= second - self.window_s:
            self._seconds.popleft()
