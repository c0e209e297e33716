"""The request lifecycle across processes (issue 25): request keys, a dead router, and a
huge prompt's tokenization.

Real processes: one nats-server, a prefill worker p1 and a decode worker d1 (default model,
one torch thread each, tcp), started once for the module; routers started per test, each
stopped (or killed) by its own pid. `-s` prints the figures docs/reliability.md quotes.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import nats
import orjson
import pytest

from libs.common.messages.control import InfoRequest, LoadReport, ServiceInfo
from scripts.cluster import LocalCluster
from tests.router.conftest import Routers, router_env
from tests.router.e2e_cluster import WORKER_ARGS, wait_healthy

pytestmark = pytest.mark.slow

LONG = {"model": "default", "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
        "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def workers(module_nats, tmp_path_factory):
    """p1 (prefill) and d1 (decode); chunked prefill of 32 tokens keeps long prompts on p1
    long enough to be caught there. Yields the LocalCluster."""
    logs = tmp_path_factory.mktemp("lifecycle-logs")
    cluster = LocalCluster(module_nats.url, env=router_env(), capture=logs)
    args = [*WORKER_ARGS, "--kv-cache-mb", "256", "--max-num-batched-tokens", "32",
            "--max-num-seqs", "32"]  # fmt: skip
    try:
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            cluster.start_one(role, "--service-id", sid, *args, label=sid)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def routers(module_nats, tmp_path) -> AsyncIterator[Routers]:
    started = Routers(module_nats.url, tmp_path)
    try:
        yield started
    finally:
        started.stop()


class Loads:
    """The latest load report of each worker, and when it came (monotonic)."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, LoadReport]] = {}

    async def on_load(self, msg) -> None:
        report = LoadReport.decode(msg.data)
        self.last[report.worker] = (time.monotonic(), report)

    def idle_since(self, worker: str, after: float) -> bool:
        """A report sent after `after` shows `worker` holding nothing."""
        at, r = self.last.get(worker, (0.0, None))
        return at > after and r.running == 0 and r.waiting == 0 and r.waiting_prefill_tokens == 0

    def busy(self, worker: str) -> bool:
        _, r = self.last.get(worker, (0.0, None))
        return r is not None and (r.running > 0 or r.waiting_prefill_tokens > 0)


async def until(predicate, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    return bool(predicate())


async def active_requests(nc, worker: str, role: str) -> int:
    msg = await nc.request(f"tandem.{role}.{worker}.info", InfoRequest().encode(), timeout=5)
    return int(ServiceInfo.decode(msg.data).details["active_requests"])


async def read_events(resp: aiohttp.ClientResponse, count: int) -> list[dict]:
    """The next `count` SSE data events (fewer if the stream ends)."""
    events: list[dict] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(orjson.loads(line[6:]))
            if len(events) >= count:
                break
    return events


async def test_workers_drop_a_killed_routers_requests_within_5s(workers, module_nats, routers):
    url = await routers.astart("r-kill")
    await wait_healthy(url, {"prefill": 1, "decode": 1}, 240, workers.procs)
    router = routers.clusters[-1].procs["router"]
    loads = Loads()
    nc = await nats.connect(module_nats.url)
    try:
        await nc.subscribe("tandem.workers.*.*.load", cb=loads.on_load)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            # A: a long generation, decoding on d1 (short prompt: d1 prefills it itself).
            story = {**LONG, "prompt": "Tell a long story about a fox."}
            a = await http.post(f"{url}/v1/completions", json=story)
            assert a.status == 200 and len(await read_events(a, 3)) == 3
            # B: a ~4900-token prompt, prefilled on p1 in chunks of 32 tokens (seconds).
            prompt = " ".join(f"w{i % 97}" for i in range(1700))
            long_prompt = {**LONG, "prompt": prompt, "max_tokens": 16}
            b = asyncio.create_task(http.post(f"{url}/v1/completions", json=long_prompt))
            assert await until(lambda: loads.busy("p1") and loads.busy("d1"), 60), loads.last
            os.kill(router.pid, signal.SIGKILL)
            killed = time.monotonic()
            idle = {}
            for w in ("d1", "p1"):
                assert await until(lambda w=w: loads.idle_since(w, killed), 10), (w, loads.last)
                idle[w] = loads.last[w][0] - killed
            b.cancel()
        print(f"\nrouter kill -9 -> idle: d1 {idle['d1']:.2f}s, p1 {idle['p1']:.2f}s")
        assert idle["d1"] < 5 and idle["p1"] < 5, idle
        assert await active_requests(nc, "d1", "decode") == 0
        assert await active_requests(nc, "p1", "prefill") == 0
    finally:
        await nc.close()
    # Both were cancelled for the router's silence (p1 mid-prompt), not finished by themselves.
    for w in ("d1", "p1"):
        assert "silent for" in (workers.capture / f"{w}.log").read_text(), w


async def test_two_routers_with_the_same_request_id_do_not_cancel_each_other(
    workers, module_nats, routers
):
    url_a = await routers.astart("r-a")
    url_b = await routers.astart("r-b")
    for url in (url_a, url_b):
        await wait_healthy(url, {"prefill": 1, "decode": 1}, 240, workers.procs)
    headers = {"x-request-id": "same-id"}
    loads = Loads()
    nc = await nats.connect(module_nats.url)
    try:
        await nc.subscribe("tandem.workers.decode.d1.load", cb=loads.on_load)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
            a = await http.post(f"{url_a}/v1/completions", headers=headers,
                                json={**LONG, "prompt": "Count to a thousand:"})  # fmt: skip
            assert a.status == 200 and a.headers["x-request-id"] == "same-id"
            assert len(await read_events(a, 2)) == 2
            body = {**LONG, "prompt": "Name the planets:", "max_tokens": 40,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            b = await http.post(f"{url_b}/v1/completions", headers=headers, json=body)
            assert b.status == 200, await b.text()
            assert b.headers["x-request-id"] == "same-id"
            assert len(await read_events(b, 2)) == 2
            a.close()  # A's client goes away: router r-a cancels its request, only its own
            rest = await read_events(b, 10_000)
        assert rest and "error" not in rest[-1], rest[-1]
        assert rest[-1]["usage"]["completion_tokens"] == 40
        assert [e["choices"][0]["finish_reason"] for e in rest if e["choices"]][-1] == "length"
        # ... and A's cancel did reach d1: it runs nothing afterwards.
        now = time.monotonic()
        assert await until(lambda: loads.idle_since("d1", now), 10), loads.last
    finally:
        await nc.close()


async def test_a_16mib_prompt_does_not_stall_the_other_streams(workers, routers):
    # The characters' limit raised past the body's: the prompt is tokenized, not refused.
    url = await routers.astart("r-tok", "--max-prompt-chars", str(32 << 20))
    await wait_healthy(url, {"prefill": 1, "decode": 1}, 240, workers.procs)
    words = "the quick brown fox jumps over a lazy dog while routers and workers talk".split()
    text = " ".join(itertools.islice(itertools.cycle(words), 3_500_000))[: (16 << 20) - 200]
    big = orjson.dumps({"model": "default", "prompt": text, "max_tokens": 1})
    assert len(big) <= 16 << 20
    arrivals: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as http:
        story = {**LONG, "prompt": "Tell a long story about a fox."}
        stream = await http.post(f"{url}/v1/completions", json=story)
        assert stream.status == 200

        async def follow() -> None:
            async for raw in stream.content:
                if raw.startswith(b"data: "):
                    arrivals.append(time.monotonic())

        reader = asyncio.create_task(follow())
        assert await until(lambda: len(arrivals) >= 5, 60)
        sent = time.monotonic()
        headers = {"Content-Type": "application/json"}
        async with http.post(f"{url}/v1/completions", data=big, headers=headers) as r:
            status, reply = r.status, await r.json()
        answered = time.monotonic()
        await asyncio.sleep(1.0)  # a stall would show as a gap ending after the answer
        reader.cancel()
        stream.close()
    assert status == 400 and "context length" in reply["error"]["message"], reply
    gaps = list(itertools.pairwise(arrivals))
    during = [b - a for a, b in gaps if b > sent and a < answered + 1]
    before = [b - a for a, b in gaps if b <= sent]
    print(f"\n16 MiB prompt answered in {answered - sent:.2f}s; inter-token gap: "
          f"max {max(during):.3f}s during it ({len(during)} gaps), "
          f"max {max(before):.3f}s before it")  # fmt: skip
    assert answered - sent > 1.0  # it was tokenized (seconds), not refused unread
    assert during and max(during) < 1.0, max(during)
