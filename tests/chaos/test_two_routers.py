"""Two routers active-active over one cluster of real processes (docs/operations.md,
"Several routers"): nats-server, prefill p1, decode d1, routers router-a and router-b.

Each router builds its own KV index from the event stream, reads the workers' loads from
the bus, and beats on its own subject; a kill -9 of one fails only the requests in flight
on it (their connection is gone), the workers free its work, the other keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.chaos.client import Outcome, Stream, complete
from tests.chaos.reports import connect, info
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import WORKER_ARGS, metric, openai_client, wait_healthy

pytestmark = pytest.mark.slow

ROUTERS = ("router-a", "router-b")
# 16 uncached tokens and up go through p1: every prompt here does.
ROUTER_ARGS = ("--port", "0", "--disagg-threshold", "16", "--heartbeat-timeout", "2")


def prompt(k: int, n: int = 40) -> list[int]:
    """A prompt of token ids of its own (plain word ids of the default model's vocabulary)."""
    return [200 + (k * 37 + i * 11) % 3000 for i in range(n)]


class TwoRouters:
    def __init__(self, workdir):
        self.nats = NatsServer(workdir / "nats").start()
        self.logs = workdir / "logs"
        self.local = LocalCluster(self.nats.url, env=router_env(), capture=self.logs)
        self.urls: dict[str, str] = {}

    def start(self) -> TwoRouters:
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            self.local.start_one(role, "--service-id", sid, *WORKER_ARGS, label=sid)
        for sid in ROUTERS:
            self.local.start_one("router", "--service-id", sid, *ROUTER_ARGS, label=sid)
        for sid in ROUTERS:
            port = asyncio.run(router_port(self.nats.url, sid, 240))
            self.urls[sid] = f"http://127.0.0.1:{port}"
            asyncio.run(wait_healthy(self.urls[sid], {"prefill": 1, "decode": 1}, 240,
                                     self.local.procs))  # fmt: skip
        return self

    def kill(self, label: str) -> None:
        proc = self.local.procs[label]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        self.local.stop()
        self.nats.stop()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    cluster = TwoRouters(tmp_path_factory.mktemp("two-routers"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_prefix_sent_through_one_router_is_a_cache_hit_through_the_other(two, http):
    # router-b learns from the KV events what router-a's request left on the workers.
    a, b = (two.urls[r] for r in ROUTERS)
    first = await complete(http, a, prompt(1, 64), 4, True)
    assert first.ok, first.error
    second = await complete(http, b, prompt(1, 64), 4, True)
    assert second.ok, second.error
    assert second.text == first.text
    assert second.usage["prompt_tokens_details"]["cached_tokens"] >= 48, second.usage


async def test_each_router_names_itself_in_its_metrics(two):
    instances = set()
    for sid in ROUTERS:
        assert await metric(two.urls[sid], "tandem:router_info", service_id=sid) == 1
        async with aiohttp.ClientSession() as s, s.get(f"{two.urls[sid]}/metrics") as r:
            text = await r.text()
        line = next(x for x in text.splitlines() if x.startswith("tandem:router_info{"))
        instances.add(line.split('instance="')[1].split('"')[0])
    assert len(instances) == 2 and "" not in instances


async def test_a_stored_response_made_through_one_router_continues_through_the_other(two):
    a, b = (two.urls[r] for r in ROUTERS)
    async with openai_client(a) as ca, openai_client(b) as cb:
        first = await ca.responses.create(model="default", input="My name is Ada. Say ok.",
                                          max_output_tokens=6, temperature=0)  # fmt: skip
        second = await cb.responses.create(model="default", input="What is my name?",
                                           previous_response_id=first.id,
                                           max_output_tokens=6, temperature=0)  # fmt: skip
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens > first.usage.input_tokens  # the stored turn
        assert (await cb.responses.retrieve(first.id)).output_text == first.output_text


def test_a_router_under_a_live_routers_service_id_refuses_to_start(two):
    # Its token subjects and request ids would collide with router-b's.
    proc = two.local.start_one("router", "--service-id", "router-b", *ROUTER_ARGS,
                               label="router-dup")  # fmt: skip
    assert proc.wait(timeout=120) == 1
    log = (two.logs / "router-dup.log").read_text()
    assert "--service-id 'router-b' is taken by a live router" in log


async def _clients(http, url: str, out: list[Outcome], stop: asyncio.Event, n: int = 2):
    """`n` clients on `url`, one short completion at a time, until `stop` (or 400 each)."""

    async def client(k: int) -> None:
        for i in range(400):
            if stop.is_set():
                return
            out.append(await complete(http, url, prompt(10 + (k + 2 * i) % 4), 8, True))

    await asyncio.gather(*(client(k) for k in range(n)))


async def _active(bus, role: str, sid: str) -> int:
    return (await info(bus, role, sid))["active_requests"]


async def test_kill_9_of_one_router_fails_only_its_requests_and_frees_its_work(two, http):
    a, b = (two.urls[r] for r in ROUTERS)
    bus = await connect(two.nats.url, "two-routers-test")
    stop, on_b = asyncio.Event(), []
    load = asyncio.create_task(_clients(http, b, on_b, stop))
    streams = [Stream(http, a, prompt(20 + k), 2000, ignore_eos=True) for k in range(3)]
    try:
        for s in streams:
            await s.wait_tokens(3, timeout=120)
        held = await _active(bus, "decode", "d1")
        assert held >= len(streams)  # router-a's streams are on d1 now
        two.kill("router-a")
        killed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 30)
        assert all(s.outcome and not s.outcome.ok for s in streams)  # their connection went
        # router-b keeps serving through and past router-a's heartbeat timeout (2 s)
        await asyncio.wait({load}, timeout=max(0.0, killed + 6 - time.monotonic()))
        stop.set()
        await asyncio.wait_for(load, 120)
        assert on_b and [o.error for o in on_b if not o.ok] == []
        after = await complete(http, b, prompt(10), 8, True)
        assert after.ok, after.error
        # the workers dropped router-a's work: nothing runs for anyone now
        deadline = time.monotonic() + 20  # far less than 2000 tokens take
        while time.monotonic() < deadline:
            left = [await _active(bus, "decode", "d1"), await _active(bus, "prefill", "p1")]
            if left == [0, 0]:
                break
            await asyncio.sleep(0.5)
        assert left == [0, 0], f"still active on d1, p1 {time.monotonic() - killed:.1f}s after"
        print(f"\ntwo routers: {len(on_b)} requests through router-b all served; "
              f"router-a's {len(streams)} streams freed on the workers")  # fmt: skip
    finally:
        stop.set()
        for s in streams:
            s.task.cancel()
        load.cancel()
        await bus.close()
