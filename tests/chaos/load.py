"""Background clients for faults "under load": the case's prompts, round robin, through the
router, until stopped; every outcome is kept with when it ended."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from tests.chaos.cases import Case
from tests.chaos.client import Outcome, complete


@dataclass
class Sent:
    prompt: int  # index in the case
    outcome: Outcome
    ended: float  # time.monotonic()


class Load:
    """`concurrency` clients, each sending one request at a time (90 s bound each)."""

    def __init__(self, http: aiohttp.ClientSession, url: str, case: Case, want: list[str],
                 concurrency: int = 2):  # fmt: skip
        self.http, self.url, self.case, self.want = http, url, case, want
        self.concurrency = concurrency
        self.sent: list[Sent] = []
        self._stop = asyncio.Event()
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> Load:
        self._tasks = [asyncio.create_task(self._client(k)) for k in range(self.concurrency)]
        return self

    async def _client(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            p = i % len(self.case.prompts)
            ids = self.case.prompts[p]
            outcome = await complete(self.http, self.url, ids, self.case.max_tokens,
                                     self.case.ignore_eos, timeout=90)  # fmt: skip
            self.sent.append(Sent(p, outcome, time.monotonic()))
            self._progress.set()
            if not outcome.ok:
                await asyncio.sleep(0.2)  # a failing system is not hammered
            i += self.concurrency

    @property
    def completed(self) -> int:
        return sum(s.outcome.ok for s in self.sent)

    def wrong(self) -> list[Sent]:
        """Completions whose text differs from the greedy reference: must never happen."""
        return [s for s in self.sent if s.outcome.ok and s.outcome.text != self.want[s.prompt]]

    def failed(self) -> list[Sent]:
        return [s for s in self.sent if not s.outcome.ok]

    async def _until(self, done, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                self._progress.clear()
                await self._progress.wait()

    async def wait_rounds(self, rounds: int, timeout: float) -> None:
        """Until every prompt completed `rounds` times."""

        def done() -> bool:
            counts = [0] * len(self.case.prompts)
            for s in self.sent:
                counts[s.prompt] += s.outcome.ok
            return min(counts) >= rounds

        await self._until(done, timeout)

    async def wait_completed(self, n: int, timeout: float) -> None:
        await self._until(lambda: self.completed >= n, timeout)

    async def stop(self, timeout: float = 100.0) -> list[Sent]:
        """Let the requests in flight end (bounded), send no more; safe to call twice."""
        self._stop.set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            self._tasks = []
        return self.sent
