"""Helpers of the planner's process tests: a planner process, and load reports to feed it."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from libs.common.messages.control import InfoRequest, LoadReport, ServiceInfo
from scripts.cluster import LocalCluster


def report(role: str, worker: str, **fields) -> LoadReport:
    base = dict(model_id="m", page_size=16, kv_dtype="fp32", waiting=0, running=0,
                waiting_prefill_tokens=0, free_pages=100, total_pages=100, tokens_per_s=0.0,
                max_model_len=2048, timestamp=time.time(), max_running=64)  # fmt: skip
    return LoadReport(worker=worker, role=role, **{**base, **fields})


class Feeder:
    """Publishes `reports` every 0.3 s (a bounded background loop) until stopped."""

    def __init__(self, nc: nats.NATS):
        self.nc = nc
        self.reports: list[LoadReport] = []
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        deadline = time.monotonic() + 300  # bounded: no test runs this long
        while time.monotonic() < deadline:
            for r in self.reports:
                await self.nc.publish(f"tandem.workers.{r.role}.{r.worker}.load", r.encode())
            await asyncio.sleep(0.3)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def planner_details(nc: nats.NATS, sid: str) -> dict:
    msg = await nc.request(f"tandem.planner.{sid}.info", InfoRequest().encode(), timeout=5)
    return ServiceInfo.decode(msg.data).details


async def wait_for(check, timeout: float, what: str):
    """Poll the async `check` every 0.3 s until it returns a truthy value (returned)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.3)
    raise AssertionError(f"not within {timeout}s: {what}")


# Short outputs: what one prefill worker hands over needs one decode worker (10 requests/s
# x 8 steps x 4 ms / (1 - 14 ms / 100 ms) = 0.37), so the tests' reports alone decide.
PLANNER_FLAGS = ["--interval", "0.5", "--scale-down-after", "1", "--worker-timeout", "2",
                 "--prefill-tokens-per-s", "1000", "--mean-prompt-tokens", "100",
                 "--mean-output-tokens", "8"]  # fmt: skip


@pytest.fixture
async def planner_cluster(nats_url, service_env, tmp_path):
    """Starts planners (`start(sid, *flags)`); stops every process it started."""
    cluster = LocalCluster(nats_url, env=service_env, capture=tmp_path / "logs")
    nc = await nats.connect(nats_url)

    async def start(sid: str, *flags: str) -> None:
        cluster.start_one("planner", "--service-id", sid, *PLANNER_FLAGS, *flags,
                          label=sid)  # fmt: skip
        await cluster.wait_ready(timeout=60)

    try:
        yield cluster, nc, start
    finally:
        await nc.close()
        cluster.stop()
