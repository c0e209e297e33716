"""Helpers of the planner's process tests: a planner process, and load reports to feed it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import pytest
from aiohttp import web

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


class LoopbackApiServer:
    """A fake Kubernetes API server on a free loopback port (no cluster runs here): a
    subclass answers GET and PATCH of its `route` (aiohttp's form) the way the API server
    does, and appends each patch received to `patches` (path, content type, body)."""

    route = ""

    def __init__(self) -> None:
        self.patches: list[tuple[str, str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def get(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def patch(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    @staticmethod
    def status(code: int, message: str) -> web.Response:
        """A failure as the API server answers it: a Status object."""
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                "message": message}  # fmt: skip
        return web.json_response(body, status=code)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(self.route, self.get)
        app.router.add_patch(self.route, self.patch)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


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
