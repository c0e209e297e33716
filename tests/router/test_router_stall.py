"""A stalled router is not a dead one (issue 39): its heartbeat goes on from a process of its
own, and its own lateness never counts against its workers. A router dead for good still
frees its work.

Real processes: one nats-server, one `--role both` worker b1 (default model, one torch
thread) and one router, started once for the module. The router's event loop is stalled by
SIGSTOP of the router process alone (its beat process goes on, services/router/dispatch/
beat_process.py); the last test kills it. `-s` prints the figures docs/reliability.md quotes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import nats
import orjson
import pytest

from libs.common.messages.control import LoadReport
from scripts.cluster import LocalCluster
from tests.router.conftest import Routers, router_env
from tests.router.e2e_cluster import WORKER_ARGS, wait_healthy

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1219, 28, 1953, 260, 1345]
# A generation that outlasts the stall's first 3 s on any host: 1 thread, speculation off
# (a short greedy prompt's output repeats itself, and drafts made 256 tokens take 1.5 s).
TOKENS = 768


@pytest.fixture(scope="module")
def cluster(module_nats, tmp_path_factory):
    """Worker b1 (`both`) and router r-stall; yields (worker cluster, routers, router URL)."""
    logs = tmp_path_factory.mktemp("stall-logs")
    workers = LocalCluster(module_nats.url, env=router_env(), capture=logs)
    routers = Routers(module_nats.url, logs)
    try:
        workers.start_one("decode", "--service-id", "b1", "--role", "both", *WORKER_ARGS,
                          "--speculation", "off", label="b1")  # fmt: skip
        url = routers.start("r-stall")
        procs = {**workers.procs, **routers.clusters[0].procs}
        asyncio.run(wait_healthy(url, {"both": 1}, 240, procs))
        yield workers, routers, url
    finally:
        routers.stop()
        workers.stop()


def router_pid(routers: Routers) -> int:
    return routers.clusters[0].procs["router"].pid


def router_log(routers: Routers) -> str:
    return (routers.logs / "r-stall" / "router.log").read_text()


class Running:
    """When b1's load reports last said it was generating (monotonic)."""

    def __init__(self) -> None:
        self.busy_at = self.idle_at = 0.0
        self.idle = asyncio.Event()

    async def on_load(self, msg) -> None:
        r = LoadReport.decode(msg.data)
        if r.running > 0:
            self.busy_at = time.monotonic()
            self.idle.clear()
        else:
            self.idle_at = time.monotonic()
            self.idle.set()


async def stream_text(resp: aiohttp.ClientResponse) -> tuple[str, list[str]]:
    """The text of a completions stream and its finish reasons."""
    text, finish = [], []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = orjson.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            if choice.get("finish_reason"):
                finish.append(choice["finish_reason"])
    return "".join(text), finish


async def stall(pid: int, seconds: float) -> None:
    """Stop the router process for `seconds`: its loop runs nothing meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)  # the stall itself, the scenario's length
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_a_stream_survives_a_10s_router_stall_exact_and_without_migration(
    cluster, module_nats
):
    workers, routers, url = cluster
    running = Running()
    nc = await nats.connect(module_nats.url)
    body = {"model": "default", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    try:
        await nc.subscribe("tandem.workers.*.b1.load", cb=running.on_load)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            # The greedy reference: the same request, not stalled, on the same worker.
            async with http.post(f"{url}/v1/completions", json=body) as ref:
                assert ref.status == 200
                expected = (await ref.json())["choices"][0]["text"]
            resp = await http.post(f"{url}/v1/completions", json={**body, "stream": True})
            assert resp.status == 200
            first = await resp.content.readline()  # the first event: generation is under way
            assert first.startswith(b"data: ")
            stopped = time.monotonic()
            await stall(router_pid(routers), 10.0)
            rest, finish = await stream_text(resp)
        text = orjson.loads(first[6:])["choices"][0]["text"] + rest
    finally:
        await nc.close()
    busy_for = running.busy_at - stopped
    print(f"\nb1 still generating {busy_for:.1f}s into the router's 10 s stall")
    # b1 went on past the workers' 2 s heartbeat timeout: it did not take the router for dead.
    assert busy_for > 3.0, busy_for
    assert text == expected and finish == ["length"]
    log = router_log(routers)
    assert "request migrates" not in log and "worker left rotation" not in log
    assert "silent for" not in (workers.capture / "b1.log").read_text()


async def index_keys(http: aiohttp.ClientSession, url: str, timeout: float = 30.0) -> int:
    """The router's KV index size once it is not 0 (b1's events come after its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        async with http.get(f"{url}/health") as r:
            keys = (await r.json())["kv_index_keys"]
        if keys or time.monotonic() > deadline:
            return keys
        await asyncio.sleep(0.2)


async def test_a_5s_router_stall_prunes_no_worker_and_drops_no_index_source(cluster):
    _, routers, url = cluster
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        # Pages of b1 in the index: a prompt of 3 full pages.
        body = {"model": "default", "prompt": PROMPT * 4, "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
        before = await index_keys(http, url)
        assert before > 0
        await stall(router_pid(routers), 5.0)
        async with http.get(f"{url}/health") as r:  # at once: the first request after it
            health = await r.json()
    assert r.status == 200 and health["workers"]["both"] == 1, health
    assert health["kv_index_keys"] >= before, (health, before)  # b1's entries were kept
    log = router_log(routers)
    assert "router event loop stalled" in log  # the stall was seen, and excused
    assert "worker left rotation" not in log and "worker forgotten" not in log


async def test_a_worker_back_within_the_forget_timeout_keeps_its_index_entries(cluster):
    workers, routers, url = cluster
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        before = await index_keys(http, url)
        assert before > 0
        await stall(workers.procs["b1"].pid, 5.0)  # b1 silent past --worker-timeout (3 s)
        assert "worker left rotation" in router_log(routers)  # it was dropped
        health = await wait_healthy(url, {"both": 1}, 30)  # and is back: rejoined
    assert health["kv_index_keys"] >= before, (health, before)
    assert "worker forgotten" not in router_log(routers)


def beat_process_of(pid: int) -> int:
    """The pid of `pid`'s child running the beat process."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"beat_process" in cmdline:
                return int(entry.name)
    raise LookupError(f"no beat process under {pid}")


async def test_a_killed_router_still_frees_its_work_and_its_beat_process_exits(
    cluster, module_nats
):
    workers, routers, url = cluster
    pid = router_pid(routers)
    beat = beat_process_of(pid)
    running = Running()
    nc = await nats.connect(module_nats.url)
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        await nc.subscribe("tandem.workers.*.b1.load", cb=running.on_load)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            resp = await http.post(f"{url}/v1/completions", json=body)
            assert resp.status == 200 and (await resp.content.readline()).startswith(b"data: ")
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            running.idle.clear()
            await asyncio.wait_for(running.idle.wait(), 10)
    finally:
        await nc.close()
    freed = running.idle_at - killed
    print(f"\nrouter kill -9 -> b1 idle after {freed:.2f}s")
    assert 0 < freed < 5, freed
    assert "silent for" in (workers.capture / "b1.log").read_text()
    assert not alive(beat), "the beat process outlived its router"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
