"""The planner with the local actuator in a real cluster under load: a router, a decode
worker, real requests. Their batch outgrows what the ITL SLO allows one worker, so the
planner starts a second decode worker, the router sends it requests, and once the load is
gone the planner stops it; every request succeeds."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from scripts.cluster import LocalCluster
from tests.chaos.client import complete
from tests.planner.conftest import wait_for
from tests.router.conftest import router_port

pytestmark = pytest.mark.slow

ENV = {"TANDEM_DECODE_NO_POOL": "true", "TANDEM_DECODE_NUM_THREADS": "1",
       "TANDEM_DECODE_KV_CACHE_MB": "64", "TANDEM_DECODE_TRANSPORT": "tcp"}  # fmt: skip
# A 50 ms ITL, 14 ms + 4 ms a sequence: 9 sequences a decode worker (no prefill worker: no
# flow to plan for).
PLANNER = ("--actuator", "local", "--min-prefill", "0", "--max-prefill", "1",
           "--max-decode", "2", "--interval", "0.5", "--scale-down-after", "3",
           "--itl-p90-ms", "50", "--decode-step-ms", "14",
           "--decode-step-per-seq-ms", "4")  # fmt: skip


def events(path, worker: str) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
    return [e for e in lines if worker in (e.get("worker"), e.get("service_id"))]


async def test_load_adds_a_decode_worker_that_serves_and_idle_removes_it(
    nats_url, service_env, tmp_path
):
    cluster = LocalCluster(nats_url, env={**service_env, **ENV}, capture=tmp_path / "logs")
    log = tmp_path / "logs" / "planner.log"
    outcomes = []
    try:
        cluster.start_one("decode", "--service-id", "decode-1")
        cluster.start_one("router", "--service-id", "router-1", "--port", "0")
        cluster.start_one("planner", "--service-id", "planner-1", *PLANNER)
        await cluster.wait_ready(timeout=120)
        url = f"http://127.0.0.1:{await router_port(nats_url, 'router-1')}"

        def p1_served() -> bool:
            return any(e.get("event") == "request accepted" for e in events(log, "decode-p1"))

        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 240
            wave = 0
            while not p1_served() and time.monotonic() < deadline:  # bounded: 240 s
                wave += 1
                prompts = [[100 + wave, 200 + i, 300 + i] for i in range(16)]
                outcomes += await asyncio.gather(
                    *(complete(http, url, p, 48, True, timeout=120) for p in prompts)
                )
        assert p1_served(), "decode-p1 was never started or never got a request"
        # The decision that added it came from decode-1's own reports: a batch past the 9
        # sequences the ITL SLO allows one worker.
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        up = next(e for e in lines if e.get("event") == "planner decision"
                  and e["changed"] and e["counts"]["decode"] == 2)  # fmt: skip
        decode = up["loads"]["decode"]
        assert decode["workers"] == 1 and decode["running"] + decode["waiting"] > 9

        async def stopped():  # logged by the planner once the process has exited
            return [e for e in events(log, "decode-p1") if e.get("event") == "worker stopped"]

        (end,) = await wait_for(stopped, 120, "the planner stopping decode-p1")
        assert end["code"] == 0  # drained, exited cleanly
        assert [o.error for o in outcomes if not o.ok] == []
        assert all(o.usage.get("completion_tokens") == 48 for o in outcomes)
    finally:
        cluster.stop()
