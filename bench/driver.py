"""The load loop: when each turn of a workload is sent, and how many are in flight.

Turns with `at` set (trace replay) go at that offset from the start. Others go in the
order they become ready, through a Poisson process of `rate` requests/s (inf: at once);
either way no more than `max_concurrency` are in flight. The loop is bounded by the
workload's `total` and by `duration` seconds: when time runs out, requests still in flight
are cancelled and recorded as failed ("cancelled at the time limit") and unsent turns are
dropped.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.client import RequestResult
from bench.workloads import Turn, Workload

Send = Callable[[Turn, float], Awaitable[RequestResult]]


@dataclass
class Arrivals:
    """The arrival process: Poisson at `rate` req/s (inf = no pacing), a concurrency cap."""

    rate: float = math.inf
    max_concurrency: int = 0  # 0: no cap
    duration: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError("--request-rate: must be > 0 (inf for no pacing)")
        if self.max_concurrency < 0:
            raise ValueError("--max-concurrency: must be >= 0")
        if not 0 < self.duration < math.inf:
            raise ValueError("--duration: must be a finite number of seconds > 0")
        self.rng = random.Random(self.seed)

    def gap(self) -> float:
        return 0.0 if math.isinf(self.rate) else self.rng.expovariate(self.rate)


async def drive(
    workload: Workload,
    send: Send,
    arrivals: Arrivals,
    on_result: Callable[[RequestResult], None] = lambda r: None,
) -> list[RequestResult]:
    """Run `workload` through `send(turn, t0)`; return every result in completion order."""
    t0 = time.perf_counter()
    deadline = t0 + arrivals.duration
    ready: deque[Turn] = deque(workload.initial())
    inflight: dict[asyncio.Task, tuple[Turn, float]] = {}
    results: list[RequestResult] = []
    next_send = t0
    sent = 0

    def finish(task: asyncio.Task) -> None:
        turn, _ = inflight.pop(task)
        res = task.result()
        results.append(res)
        on_result(res)
        ready.extend(workload.done(turn, res.ok, res.text))

    try:
        while (ready and sent < workload.total) or inflight:
            now = time.perf_counter()
            if now >= deadline:
                break
            cap_full = arrivals.max_concurrency and len(inflight) >= arrivals.max_concurrency
            wait = deadline - now
            if ready and not cap_full and sent < workload.total:
                turn = ready[0]
                due = t0 + turn.at if turn.at is not None else next_send
                if due <= now:
                    ready.popleft()
                    task = asyncio.create_task(send(turn, t0))
                    inflight[task] = (turn, now)
                    sent += 1
                    if turn.at is None:
                        next_send = max(next_send, now) + arrivals.gap()
                    continue
                wait = min(wait, due - now)
            if not inflight:
                await asyncio.sleep(wait)
                continue
            done, _ = await asyncio.wait(
                inflight, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                finish(task)
    finally:
        for task in inflight:
            task.cancel()
        for task, (turn, started) in list(inflight.items()):
            try:
                res = await task
            except asyncio.CancelledError:
                res = RequestResult(turn.request_id, turn.client, turn.round)
                res.error = "cancelled at the time limit"
                res.start = started - t0
                res.e2e = time.perf_counter() - started
            results.append(res)
            on_result(res)
    return results
