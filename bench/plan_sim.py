"""A cluster of prefill and decode workers in simulated time, for bench.plan.

Fluid ticks of `dt` seconds. A prefill worker computes its queue's prompts in order at
the measured rate; a prompt's end is its first token (TTFT). The request then joins the
decode worker with the fewest sequences: it runs when a seat is free, else waits (its
wait counts into its ITL). A decode worker with `b` running sequences steps every
`Capacity.step_s(b)` seconds, one token each. A policy sees a `LoadReport` per ready
worker every `interval` (the messages the service reads) and the TTFT/ITL of requests
finished since its last look, and answers the count per role (a report carries the TTFT
and token spacing p90 its worker saw over the last 10 s, as a real worker's does); new
workers are ready after `startup_s` and cost worker-seconds from the moment they are
asked for; a removed worker takes no new work and leaves when empty.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common.messages.control import LoadReport
from libs.common.worker.latency import LatencyWindow
from services.planner.policy import Capacity


@dataclass
class Req:
    arrival: float
    prompt: int
    output: int
    prefill_left: float = 0.0
    first_token: float | None = None
    decode_s: float = 0.0
    generated: float = 0.0
    done: float | None = None

    @property
    def ttft(self) -> float:
        return (self.first_token or 0.0) - self.arrival

    @property
    def itl(self) -> float:
        return self.decode_s / max(1, self.output - 1)


@dataclass
class Worker:
    role: str
    name: str
    asked_at: float
    ready_at: float
    draining: bool = False
    gone_at: float | None = None
    queue: collections.deque = field(default_factory=collections.deque)  # (enqueued, Req)
    running: list = field(default_factory=list)
    tokens_in: int = 0
    ttft: LatencyWindow = field(default_factory=LatencyWindow)
    itl: LatencyWindow = field(default_factory=LatencyWindow)

    def empty(self) -> bool:
        return not self.queue and not self.running

    def open(self, now: float) -> bool:
        return not self.draining and self.ready_at <= now


Observer = Callable[[list[LoadReport], list[Req], dict[str, int], float], dict[str, int]]


@dataclass
class Cluster:
    cap: Capacity
    startup_s: float
    workers: list[Worker] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)
    _count: int = 0

    def desired(self) -> dict[str, int]:
        return {r: sum(1 for w in self.workers if w.role == r and not w.draining)
                for r in ("prefill", "decode")}  # fmt: skip

    def scale(self, want: dict[str, int], now: float, ready: float | None = None) -> None:
        for role, n in want.items():
            live = [w for w in self.workers if w.role == role and not w.draining]
            for _ in range(n - len(live)):
                self._count += 1
                at = now + self.startup_s if ready is None else ready
                self.workers.append(Worker(role, f"{role}-{self._count}", now, at))
            for w in sorted(live, key=lambda w: -w.asked_at)[: max(0, len(live) - n)]:
                w.draining = True

    def open(self, role: str, now: float) -> list[Worker]:
        """Workers of `role` taking new work; if none is ready, those not leaving."""
        alive = [w for w in self.workers if w.role == role and w.gone_at is None]
        return [w for w in alive if w.open(now)] or [w for w in alive if not w.draining]

    def arrive(self, req: Req, now: float) -> None:
        req.prefill_left = req.prompt
        target = min(
            self.open("prefill", now), key=lambda w: sum(r.prefill_left for _, r in w.queue)
        )
        target.queue.append((now, req))
        target.tokens_in += req.prompt

    def tick(self, now: float, dt: float) -> None:
        for w in self.workers:
            if w.gone_at is None and w.ready_at <= now:
                (self._prefill if w.role == "prefill" else self._decode)(w, now, dt)
            if w.draining and w.empty() and w.gone_at is None:
                w.gone_at = now

    def _prefill(self, w: Worker, now: float, dt: float) -> None:
        budget = self.cap.prefill_tokens_per_s * dt
        while w.queue and budget > 0:
            _, req = w.queue[0]
            used = min(budget, req.prefill_left)
            req.prefill_left -= used
            budget -= used
            if req.prefill_left <= 1e-9:
                w.queue.popleft()
                req.first_token = now + dt - budget / self.cap.prefill_tokens_per_s
                w.ttft.add(req.first_token - req.arrival, now=now)
                if req.output <= 1:
                    req.done = req.first_token
                    self.finished.append(req)
                    continue
                dest = min(self.open("decode", now), key=lambda d: len(d.running) + len(d.queue))
                dest.queue.append((now, req))
                dest.tokens_in += req.prompt

    def _decode(self, w: Worker, now: float, dt: float) -> None:
        while w.queue and len(w.running) < self.cap.decode_seats:
            w.running.append(w.queue.popleft()[1])
        for _, req in w.queue:
            req.decode_s += dt
        if not w.running:
            return
        tokens = dt / self.cap.step_s(len(w.running))
        w.itl.add(self.cap.step_s(len(w.running)), weight=len(w.running), now=now)
        still = []
        for req in w.running:
            req.decode_s += dt
            req.generated += tokens
            if req.generated >= req.output - 1:
                req.done = now + dt
                self.finished.append(req)
            else:
                still.append(req)
        w.running = still

    def reports(self, now: float, interval: float) -> list[LoadReport]:
        out = []
        for w in self.workers:
            if w.gone_at is not None or w.ready_at > now:
                continue
            waiting = list(w.queue)[1:] if w.role == "prefill" else list(w.queue)
            busy = 1 if w.role == "prefill" and w.queue else len(w.running)
            out.append(LoadReport(
                worker=w.name, role=w.role, model_id="sim", page_size=16, kv_dtype="sim",
                waiting=len(waiting), running=busy,
                waiting_prefill_tokens=int(sum(r.prefill_left for _, r in w.queue)),
                free_pages=0, total_pages=0, tokens_per_s=0.0, max_model_len=0,
                timestamp=now, max_running=self.cap.decode_seats,
                queue_time_s=max((now - t for t, _ in waiting), default=0.0),
                prompt_tokens_per_s=w.tokens_in / interval,
                ttft_p90_s=w.ttft.quantile(0.9, now=now), itl_p90_s=w.itl.quantile(0.9, now=now),
            ))  # fmt: skip
            w.tokens_in = 0
        return out

    def worker_seconds(self, end: float, start: float = 0.0) -> dict[str, float]:
        """Each worker's time from asked for to gone, the part between `start` and `end`."""
        out = {"prefill": 0.0, "decode": 0.0}
        for w in self.workers:
            gone = min(end, w.gone_at if w.gone_at is not None else end)
            out[w.role] += max(0.0, gone - max(start, w.asked_at))
        return out


@dataclass(frozen=True)
class Run:
    dt: float = 0.05
    interval: float = 2.0
    max_s: float = 7200.0  # a bound on simulated time past the last arrival
    warmup_s: float = 0.0  # worker-seconds counted from here


def simulate(trace: list[Req], cluster: Cluster, decide: Observer, run: Run) -> dict:
    """Replay `trace` (sorted by arrival) through `cluster` under `decide`."""
    pending = collections.deque(sorted(trace, key=lambda r: r.arrival))
    now, next_look, seen = 0.0, run.interval, 0
    end = (pending[-1].arrival if pending else 0.0) + run.max_s
    events = 0
    while (pending or len(cluster.finished) < len(trace)) and now < end:
        while pending and pending[0].arrival <= now:
            cluster.arrive(pending.popleft(), now)
        cluster.tick(now, run.dt)
        now += run.dt
        if now >= next_look:
            next_look += run.interval
            before = cluster.desired()
            want = decide(cluster.reports(now, run.interval), cluster.finished[seen:], before, now)
            seen = len(cluster.finished)
            cluster.scale(want, now)
            events += int(want != before)
    return {
        "end_s": now,
        "scale_changes": events,
        "worker_seconds": cluster.worker_seconds(now, run.warmup_s),
    }
