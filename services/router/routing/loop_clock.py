"""A monotonic clock that stops while this process's event loop is stalled.

The router judges its workers by how long it has heard nothing from them. While its own
event loop is blocked (a slow request, a GC pause, SIGSTOP), it hears no one, and their
load reports wait unread in its socket: that time is the router's lateness, not their
silence. `LoopClock` reads like `time.monotonic()` except that it does not advance past
one `period` after the last `tick()`: a task on the loop calls `tick()` every `period`,
and whatever it comes back later than that is excused, while the stall lasts (the clock
stands still) and after it (the excused time is subtracted for good).

So a deadline measured on this clock (the WorkerTable's `--worker-timeout` and
`--worker-forget-timeout`) counts only the time the loop was running and could have heard
the worker. A loop that is merely busy excuses its ticks' lateness too: a dead worker is
then found a little later, never a live one taken for dead.

Pure Python; the base clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LoopClock:
    """`clock()`: seconds, monotonic, standing still from `period` after the last `tick()`."""

    def __init__(self, period: float, base: Callable[[], float] = time.monotonic):
        if period <= 0:
            raise ValueError(f"period must be > 0, got {period}")
        self.period = period
        self.base = base
        self._last = base()
        self._excused = 0.0
        self.stalled = 0.0  # seconds excused in all, for logs and tests

    def __call__(self) -> float:
        now = self.base()
        return now - self._excused - max(0.0, now - self._last - self.period)

    def tick(self) -> float:
        """The loop ran now. Returns the lateness excused: how much later than `period`
        after the previous tick this one came (0.0 when on time)."""
        now = self.base()
        late = max(0.0, now - self._last - self.period)
        self._excused += late
        self.stalled += late
        self._last = now
        return late
