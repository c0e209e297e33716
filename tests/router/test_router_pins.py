"""/v1/pins on a real cluster (issue 26, soft pinning): nats-server, the pool (a master and
one 16 MiB store: 22 page objects of the default model), a prefill and a decode worker
with the default model writing their pages to the pool, and the router.

A system prompt pinned through the API is held by the master once a chat with it has run,
and stays while other traffic fills the pool many times over and evicts an unpinned
system prompt used after it. Bad input gets OpenAI-shaped 4xx. Slow (model load).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import nats
import pytest

from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolStats
from scripts.cluster import REPO, LocalCluster
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import wait_healthy

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--num-threads", "1", "--kv-cache-mb", "128", "--transport", "tcp"]
# 40% of 16 MiB holds 8 pages of 720 KiB (fp32 KV of the default model, 16 tokens a page).
MASTER_ARGS = ["--max-pinned-fraction", "0.4", "--election", "false"]
SYSTEM = ("You are the support assistant of the Tandem river ferry company. Answer in one "
          "short sentence, name the pier when asked about departures, and never invent "
          "a timetable. Ferries leave from North Pier and South Pier; tickets are sold on "
          "board and online; bicycles travel free; dogs travel on a leash; the last ferry "
          "leaves at ten in the evening.")  # fmt: skip
OTHER_SYSTEM = ("You are a terse assistant for a bakery. You list bread names and prices "
                "only, and you answer in French when spoken to in French.")  # fmt: skip


@pytest.fixture(scope="module")
def cluster(module_nats, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pin-logs")
    local = LocalCluster(module_nats.url, env=router_env(), capture=logs)
    try:
        local.start_one("cache_master", "--service-id", "m1", *MASTER_ARGS)
        local.start_one("cache_store", "--service-id", "s1", "--segment-size", "16MiB",
                        "--transport", "tcp", "--heartbeat-interval", "0.3")  # fmt: skip
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            local.start_one(role, "--service-id", sid, *WORKER_ARGS, label=sid)
        local.start_one("router", "--service-id", "router-pins", "--port", "0")
        port = asyncio.run(router_port(module_nats.url, "router-pins", 240))
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url, {"prefill": 1, "decode": 1}, 240, local.procs))
        yield url, module_nats.url
    finally:
        local.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def call(http, method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with http.request(method, url, json=body) as r:
        return r.status, await r.json()


async def chat(http, url: str, system: str, question: str) -> None:
    body = {"model": "default", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}  # fmt: skip
    status, reply = await call(http, "POST", f"{url}/v1/chat/completions", body)
    assert status == 200, reply


async def pin_of(http, url: str, pin_id: str) -> dict:
    status, listed = await call(http, "GET", f"{url}/v1/pins")
    assert status == 200, listed
    return next(p for p in listed["data"] if p["id"] == pin_id)


async def pool_stats(nats_url: str) -> PoolStats:
    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request("tandem.pool.master.stats", InfoRequest().encode(), timeout=5)
        return PoolStats.decode(msg.data)
    finally:
        await nc.close()


async def wait_present(http, url: str, pin_id: str, timeout: float = 60.0) -> dict:
    """Until every page of the pin is in the pool and held (write-backs are async)."""
    deadline = time.monotonic() + timeout
    while True:
        pin = await pin_of(http, url, pin_id)
        if pin["present"] == pin["pages"] == pin["held"]:
            return pin
        assert time.monotonic() < deadline, f"pinned pages not all in the pool: {pin}"
        await asyncio.sleep(0.3)


async def test_a_pinned_system_prompt_stays_in_the_pool_while_other_traffic_evicts_the_rest(
    cluster, http
):
    url, nats_url = cluster
    messages = [{"role": "system", "content": SYSTEM}]
    status, pin = await call(http, "POST", f"{url}/v1/pins",
                             {"messages": messages, "ttl_s": 600, "label": "ferry"})  # fmt: skip
    assert status == 200, pin
    assert pin["object"] == "pin" and pin["label"] == "ferry" and 4 <= pin["pages"] <= 8, pin

    # The chat's pages are the pinned keys: the worker's write-back makes them present.
    await chat(http, url, SYSTEM, "When does the first ferry leave?")
    held = await wait_present(http, url, pin["id"])
    assert held["bytes"] == held["pages"] * 720 * 1024

    # An unpinned system prompt, used after the pinned one (younger in the LRU).
    await chat(http, url, OTHER_SYSTEM, "Combien coûte une baguette ?")
    await asyncio.sleep(1.0)
    before = await pool_stats(nats_url)
    for i in range(5):  # ~19 pages each: 4x the segment
        text = " ".join(f"Record {i}.{j}: the lighthouse keeper logged wind {j} knots."
                        for j in range(22))  # fmt: skip
        body = {"model": "default", "prompt": text, "max_tokens": 1}
        status, reply = await call(http, "POST", f"{url}/v1/completions", body)
        assert status == 200, reply
    await asyncio.sleep(1.5)  # the last write-backs land
    after = await pool_stats(nats_url)
    assert after.evictions - before.evictions >= 30, (before, after)

    assert await pin_of(http, url, pin["id"]) == {**held, "expires_at": held["expires_at"]}
    # The unpinned one is gone: pinning it now finds none of its pages present.
    status, other = await call(http, "POST", f"{url}/v1/pins",
                               {"messages": [{"role": "system", "content": OTHER_SYSTEM}],
                                "ttl_s": 60})  # fmt: skip
    assert status == 200 and other["present"] == 0, other
    status, gone = await call(http, "DELETE", f"{url}/v1/pins/{other['id']}")
    assert (status, gone) == (200, {"object": "pin.deleted", "id": other["id"], "deleted": True})


async def test_a_pin_over_the_pinned_fraction_is_refused_with_409(cluster, http):
    url, nats_url = cluster
    if (await pool_stats(nats_url)).objects == 0:  # absent pages are priced by a present one
        await chat(http, url, SYSTEM, "Hello?")
    long = " ".join(f"Clause {i}: the ferry may be late when the tide is low." for i in range(20))
    status, body = await call(http, "POST", f"{url}/v1/pins", {"prompt": long, "ttl_s": 60})
    assert status == 409, body
    assert body["error"]["code"] == "pin_limit", body
    assert "--max-pinned-fraction" in body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": SYSTEM}, "ttl_s"),
        ({"prompt": SYSTEM, "ttl_s": 0}, "ttl_s"),
        ({"prompt": SYSTEM, "ttl_s": 10**9}, "ttl_s"),  # over the master's --max-pin-ttl
        ({"prompt": SYSTEM, "messages": [{"role": "system", "content": "x"}], "ttl_s": 5},
         "prompt"),
        ({"ttl_s": 5}, "prompt"),
        ({"prompt": "Hi", "ttl_s": 5}, "prompt"),  # under one page
        ({"prompt": SYSTEM, "ttl_s": 5, "priority": 1}, "priority"),
        ({"messages": [{"role": "nobody"}], "ttl_s": 5}, "messages"),
    ],
)  # fmt: skip
async def test_bad_pin_requests_get_a_400_naming_the_parameter(cluster, http, body, param):
    url, _ = cluster
    status, reply = await call(http, "POST", f"{url}/v1/pins", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


async def test_deleting_an_unknown_pin_is_a_404(cluster, http):
    url, _ = cluster
    for pin_id in ("0123456789abcdef", "not-a-pin"):
        status, reply = await call(http, "DELETE", f"{url}/v1/pins/{pin_id}")
        assert status == 404 and reply["error"]["code"] == "pin_not_found", reply


def run_pin(url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scripts.pin", "--url", url, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


async def test_the_operator_command_adds_lists_and_removes_a_pin(cluster):
    url, _ = cluster
    added = await asyncio.to_thread(run_pin, url, "add", "--system", OTHER_SYSTEM, "--ttl",
                                    "120", "--label", "bakery")  # fmt: skip
    assert added.returncode == 0, added.stderr
    pin = json.loads(added.stdout)
    listed = await asyncio.to_thread(run_pin, url, "list", "--json")
    assert pin["id"] in [p["id"] for p in json.loads(listed.stdout)["data"]]
    table = await asyncio.to_thread(run_pin, url, "list")
    assert "bakery" in table.stdout and "allowed" in table.stdout
    assert (await asyncio.to_thread(run_pin, url, "rm", pin["id"])).returncode == 0
    again = await asyncio.to_thread(run_pin, url, "rm", pin["id"])
    assert again.returncode == 1 and "404" in again.stderr
    refused = await asyncio.to_thread(run_pin, url, "add", "--text", SYSTEM, "--ttl", "0")
    assert refused.returncode == 1 and "400" in refused.stderr and "ttl_s" in refused.stderr
