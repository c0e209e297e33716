"""The load `make upgrade-test` (scripts/upgrade_test.py) runs through the router: cohorts
of multi-turn conversations cut into phases (before and after the upgrade), refusals
retried as a client in front of one router would, a Record of every request with its
wall-clock times (so that a failure maps to the restart it overlapped), and the
background conversations that run during the upgrade.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.client import Endpoint, RequestResult, send
from bench.driver import Arrivals, drive
from bench.workloads import MultiTurn, Turn

MAX_BACKGROUND_BATCHES = 200  # bounds the background load even if the upgrade never ends


class Phase:
    """A MultiTurn workload run up to (not including) round `until`: later turns it would
    release are kept in `held`, for the next Phase to start from (`first`)."""

    def __init__(self, inner: MultiTurn, until: int, first: list[Turn] | None = None):
        self.inner, self.until, self.first = inner, until, first
        self.held: list[Turn] = []
        self.total = inner.total

    def initial(self) -> list[Turn]:
        return list(self.first) if self.first is not None else self.inner.initial()

    def done(self, turn: Turn, ok: bool, text: str) -> list[Turn]:
        released = self.inner.done(turn, ok, text)
        self.held += [t for t in released if t.round >= self.until]
        return [t for t in released if t.round < self.until]


@dataclass
class Record:
    """One request as the test saw it: wall-clock times, so failures map to restarts."""

    label: str
    result: RequestResult
    began: float
    ended: float
    retries: list[str] = field(default_factory=list)


def refusal(res: RequestResult) -> str | None:
    """Why the router refused `res` before generating anything (retry), or None."""
    if res.ok or res.ttft:
        return None
    err = res.error
    for reason in ("ClientConnectorError", "ServerDisconnectedError", "ClientOSError"):
        if err.startswith(reason):
            return reason
    for status in ("HTTP 503", "HTTP 429"):
        if err.startswith(status):
            return status
    return None


class Load:
    """Sends turns through the router, retrying refusals; keeps a Record of each."""

    def __init__(self, http: aiohttp.ClientSession, endpoint: Endpoint, retry_for: float):
        self.http, self.endpoint, self.retry_for = http, endpoint, retry_for
        self.records: list[Record] = []

    async def send(self, label: str, turn: Turn, t0: float) -> RequestResult:
        began, retries = time.time(), []
        deadline = time.monotonic() + self.retry_for
        while True:
            res = await send(self.http, self.endpoint, turn, t0)
            reason = refusal(res)
            if reason is None or time.monotonic() > deadline:
                break
            retries.append(reason)
            await asyncio.sleep(1.0)
        self.records.append(Record(label, res, began, time.time(), retries))
        return res

    async def run(self, label: str, workload: Phase | MultiTurn, concurrency: int) -> None:
        arrivals = Arrivals(max_concurrency=concurrency, duration=900.0)

        async def one(turn: Turn, t0: float) -> RequestResult:
            return await self.send(label, turn, t0)

        await drive(workload, one, arrivals)

    def hit_rate(self, label: str, rounds: range) -> dict[str, Any]:
        done = [r.result for r in self.records if r.label == label and r.result.ok]
        per_round = {}
        for n in rounds:
            rs = [r for r in done if r.round == n]
            prompt = sum(r.prompt_tokens for r in rs)
            per_round[n] = round(sum(r.cached_tokens for r in rs) / prompt, 4) if prompt else None
        rs = [r for r in done if r.round in rounds]
        prompt = sum(r.prompt_tokens for r in rs)
        rate = sum(r.cached_tokens for r in rs) / prompt if prompt else 0.0
        return {"hit_rate": round(rate, 4), "requests": len(rs), "prompt_tokens": prompt,
                "per_round": per_round}  # fmt: skip


async def background(load: Load, stop: asyncio.Event, concurrency: int) -> int:
    """Short multi-turn conversations, batch after batch, until `stop` (bounded)."""
    batch = 0
    while not stop.is_set() and batch < MAX_BACKGROUND_BATCHES:
        workload = MultiTurn(clients=concurrency, rounds=6, request_len=96, question_len=24,
                             output_len=4, seed=1000 + batch)  # fmt: skip
        await load.run("background", workload, concurrency)
        batch += 1
    return batch
