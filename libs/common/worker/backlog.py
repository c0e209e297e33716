"""Admission by expected queueing delay: prompt tokens waiting for their prefill, and how
fast they drain.

A decode worker accepts a request, then the request waits for its prefill (on a prefill
worker, or in its own engine). Under overload that wait grows without bound while the
client sees nothing: bounded only by KV pages, bench.load's 256 clients waited minutes
for a first token (docs/reliability.md, "Load"). `PromptBacklog` estimates the wait of
a new prompt as

    (tokens queued + its tokens) / tokens drained per second over the last `window_s`

and the worker answers 429 (the router's back-pressure path: wait, route again, then 429
with Retry-After to the client) when it exceeds --max-queue-delay. Nothing is refused
while the queue is empty or before the first `window_s` of history (no rate known yet);
a queue that drained nothing for a whole window refuses until it moves.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable


class PromptBacklog:
    """Queued prompt tokens and their drain rate; pure bookkeeping, no I/O."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s: must be > 0, got {window_s}")
        self.window_s, self.clock = window_s, clock
        self.queued = 0
        self._since: float | None = None  # when the queue last became non-empty
        self._drained: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, tokens: int) -> None:
        if self.queued == 0:
            self._since = self.clock()
        self.queued += tokens

    def done(self, tokens: int) -> None:
        """`tokens` of a prompt no longer wait (prefilled, failed or cancelled)."""
        self.queued = max(0, self.queued - tokens)
        self._drained.append((self.clock(), tokens))

    def rate(self) -> float | None:
        """Tokens drained per second over the window; None while history is too short."""
        now = self.clock()
        while self._drained and self._drained[0][0] < now - self.window_s:
            self._drained.popleft()
        busy = now - self._since if self._since is not None else 0.0
        if busy < self.window_s:
            return None
        return sum(n for _, n in self._drained) / self.window_s

    def expected_wait(self, tokens: int) -> float:
        """Seconds a prompt of `tokens` added now would wait (0 when unknown or idle)."""
        if self.queued == 0:
            return 0.0
        rate = self.rate()
        if rate is None:
            return 0.0
        return (self.queued + tokens) / rate if rate > 0 else float("inf")
