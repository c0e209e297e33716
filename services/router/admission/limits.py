"""Two measures the gate keeps: a tenant's tokens per minute (a token bucket) and the
router's own throughput in tokens per second of busy time, from finished requests.

Pure Python; the clock is passed in by the caller.
"""

from __future__ import annotations

import collections

# Before any request has finished, the router assumes this many tokens/s (prompt and
# completion tokens together); the first finished requests replace it (docs/routing.md).
START_TOKENS_PER_S = 1000.0
WINDOW_S = 30.0


class TokenBucket:
    """`per_minute` tokens a minute, up to a minute's worth saved up."""

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.at = now

    def take(self, tokens: int, now: float) -> float:
        """Take `tokens` and return 0.0, or take nothing and return the seconds until they
        are there (inf when they never fit: more than a minute's worth)."""
        self._fill(now)
        if tokens > self.capacity:
            return float("inf")
        if tokens <= self.level:
            self.level -= tokens
            return 0.0
        return (tokens - self.level) / self.rate

    def give_back(self, tokens: int, now: float) -> None:
        """Return what a request was charged and did not use."""
        self._fill(now)
        self.level = min(self.capacity, self.level + max(0, tokens))

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now


class Throughput:
    """Tokens finished per second while the router had work running, over the last
    WINDOW_S seconds (idle time does not count, so a quiet minute does not make the next
    burst look slow)."""

    def __init__(self, now: float, start: float = START_TOKENS_PER_S):
        self._start = start
        self._tokens = 0  # finished since start
        self._busy = 0.0  # seconds with something running, up to `_busy_since`
        self._busy_since: float | None = None
        self._samples: collections.deque[tuple[float, int, float]] = collections.deque()
        self._samples.append((now, 0, 0.0))
        self._last = start

    def running(self, busy: bool, now: float) -> None:
        """Whether anything runs from `now` on."""
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self._busy += now - self._busy_since
            self._busy_since = None

    def finished(self, tokens: int, now: float) -> None:
        self._tokens += max(0, tokens)
        self._samples.append((now, self._tokens, self._busy_time(now)))
        while len(self._samples) > 2 and self._samples[1][0] < now - WINDOW_S:
            self._samples.popleft()

    def per_s(self, now: float) -> float:
        """The measured rate, or the last one (the start value before any) when the window
        holds too little to measure."""
        _, tokens0, busy0 = self._samples[0]
        _, tokens1, busy1 = self._samples[-1]
        if tokens1 > tokens0 and busy1 - busy0 > 0.05:
            self._last = (tokens1 - tokens0) / (busy1 - busy0)
        return self._last

    def _busy_time(self, now: float) -> float:
        return self._busy + (now - self._busy_since if self._busy_since is not None else 0.0)
