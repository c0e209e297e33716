"""Live workers, from their load reports (`tandem.workers.<role>.<id>.load`).

A worker is live while its last report is younger than `timeout` seconds; `prune()` takes
the silent ones out of rotation and returns them (the service then fails over what they
held). A pruned worker is not yet forgotten: its KV-index entries stay until `forget()`
returns it, when it has been silent for `forget_timeout` (it is really gone) or when it
came back as another process instance (a restart: its cache is new). One that comes back
as the same instance before then simply rejoins, its entries intact. The service runs the
table on a `LoopClock` (loop_clock.py): the router's own stalls never count as a worker's
silence. Besides the last report, the table keeps what this router sent a worker since:
requests and prompt tokens not yet acknowledged by a report, so that a burst of requests
between two reports does not all land on the worker that looked idle.

Pure Python; the clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common.messages.control import LoadReport

ROLES = ("prefill", "decode", "both")


@dataclass
class Worker:
    """One worker's last report, when it came, and this router's own in-flight view."""

    report: LoadReport
    seen_at: float
    inflight: set[str] = field(default_factory=set)  # request ids sent and not finished
    pending_prefill_tokens: int = 0  # prompt tokens sent and not yet first-tokened

    @property
    def id(self) -> str:
        return self.report.worker

    @property
    def role(self) -> str:
        return self.report.role

    @property
    def queued_prefill_tokens(self) -> int:
        # The report already counts what it has seen; the router's own count covers the
        # requests sent since. max() rather than a sum avoids counting a request twice.
        return max(self.report.waiting_prefill_tokens, self.pending_prefill_tokens)

    @property
    def running(self) -> int:
        return max(self.report.running + self.report.waiting, len(self.inflight))

    @property
    def kv_usage(self) -> float:
        total = self.report.total_pages
        return 1.0 - self.report.free_pages / total if total > 0 else 1.0


class WorkerTable:
    """Workers by id. `live(role)` never returns one silent for `timeout` seconds or more."""

    def __init__(
        self,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        forget_timeout: float = 0.0,
    ):
        self.timeout, self.forget_timeout = timeout, forget_timeout
        self.clock = clock
        self._workers: dict[str, Worker] = {}
        self._gone: dict[str, Worker] = {}  # pruned, not yet forgotten
        self._replaced: list[Worker] = []  # gone, then back as another instance

    def __len__(self) -> int:
        return len(self._workers)

    def update(self, report: LoadReport) -> bool:
        """Record a report; True when the worker is new (or back after being dropped, or
        restarted: another process instance under the same id starts afresh)."""
        if report.role not in ROLES:
            return False
        gone = self._gone.pop(report.worker, None)
        if gone is not None and gone.report.instance == report.instance:
            gone.report, gone.seen_at = report, self.clock()  # back: keeps what it held
            self._workers[report.worker] = gone
            return True
        if gone is not None:
            self._replaced.append(gone)
        w = self._workers.get(report.worker)
        if w is None or w.report.instance != report.instance:
            self._workers[report.worker] = Worker(report, self.clock())
            return True
        w.report, w.seen_at = report, self.clock()
        return False

    def get(self, worker_id: str) -> Worker | None:
        w = self._workers.get(worker_id)
        return w if w is not None and self._alive(w) else None

    def is_live(self, worker_id: str, instance: str = "") -> bool:
        """`worker_id` reports; with `instance`, still from that process (not restarted)."""
        w = self.get(worker_id)
        return w is not None and (not instance or w.report.instance == instance)

    def live(self, *roles: str) -> list[Worker]:
        return [w for w in self._workers.values() if w.role in roles and self._alive(w)]

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def prune(self) -> list[Worker]:
        """Take out of rotation and return the workers that stopped reporting."""
        dead = [w for w in self._workers.values() if not self._alive(w)]
        for w in dead:
            del self._workers[w.id]
            self._gone[w.id] = w
        return dead

    def forget(self) -> list[Worker]:
        """Remove and return the pruned workers that are really gone: silent for
        `forget_timeout`, or back as another instance. Their KV-index entries go now."""
        now = self.clock()
        out, self._replaced = self._replaced, []
        for w in [w for w in self._gone.values() if now - w.seen_at >= self.forget_timeout]:
            del self._gone[w.id]
            out.append(w)
        return out

    def ready(self) -> bool:
        """At least one prefill and one decode worker, or one `both` worker, are live."""
        if self.live("both"):
            return True
        return bool(self.live("prefill")) and bool(self.live("decode"))

    def _alive(self, w: Worker) -> bool:
        return self.clock() - w.seen_at < self.timeout
