"""The router end to end on a real cluster: two prefill workers, one decode worker, the
default model, a real nats-server; requests through the official `openai` client.

Slow (the workers load the model): marked `slow`. One cluster serves the whole module;
tests that disturb it (a second router, a paused worker) come last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import nats
import openai
import pytest

from libs.common.bus.connection import settle
from libs.common.engine.load.source import load_tokenizer
from libs.common.messages.control import CancelRequest, LoadReport
from services.router.api import openapi
from tests.router.conftest import Routers
from tests.router.e2e_cluster import cluster_fixture, metric, openai_client, wait_healthy
from tests.router.schema_check import check, response_schema

pytestmark = pytest.mark.slow

DOC = openapi.document("default")
LONG = " ".join(f"Fact {i}: the river number {i} flows to the sea." for i in range(30))


cluster = cluster_fixture("e2e-logs", ["--disagg-threshold", "32"])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")[0]


@pytest.fixture
async def c(cluster):
    async with openai_client(cluster.url) as client:
        yield client


async def test_completion_sync_and_stream_agree_with_exact_usage(cluster, tokenizer, c):
    prompt = "The capital of France is"
    r = await c.completions.create(model="default", prompt=prompt, max_tokens=6,
                                   temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert not check(r.model_dump(), response_schema(DOC, "/v1/completions", "POST", 200), DOC)
    n_prompt = len(tokenizer.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 6)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    stream = await c.completions.create(
        model="default", prompt=prompt, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, usage, finish = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert (text, finish) == (r.choices[0].text, "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 6)


async def test_chat_sync_and_stream_with_logprobs_n_and_stop(cluster, tokenizer, c):
    messages = [{"role": "user", "content": "Name three colors."}]
    r = await c.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                        temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    assert not check(r.model_dump(), response_schema(DOC, "/v1/chat/completions", "POST", 200),
                     DOC)  # fmt: skip
    content = r.choices[0].message.content
    assert content and len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert "".join(t.token for t in r.choices[0].logprobs.content) == content
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert r.usage.prompt_tokens == len(prompt_ids)
    stream = await c.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                             temperature=0, stream=True)  # fmt: skip
    pieces = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
    assert "".join(pieces) == content
    many = await c.chat.completions.create(model="default", messages=messages, max_tokens=4,
                                           n=3, temperature=1.0, seed=7)  # fmt: skip
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    assert many.usage.prompt_tokens == len(prompt_ids)
    stop = content.split()[1] if len(content.split()) > 1 else content[-1]
    cut = await c.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                          temperature=0, stop=[stop])  # fmt: skip
    assert stop not in cut.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop"


async def test_echo_prepends_the_prompt(cluster, c):
    r = await c.completions.create(
        model="default", prompt="One, two,", max_tokens=3, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith("One, two,")


async def test_repeated_long_prefix_goes_to_the_worker_that_holds_it(cluster, tokenizer, c):
    n_long = len(tokenizer.encode(LONG))
    assert n_long > 300
    first = await c.completions.create(model="default", prompt=LONG + " Q0", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens < 16
    await asyncio.sleep(1.0)  # the holders' KV events reach the router
    before = await metric(cluster.url, "tandem:router_expected_cached_pages_total")
    for i in range(1, 4):
        r = await c.completions.create(model="default", prompt=f"{LONG} Q{i}", max_tokens=2)
        # Whichever worker computed it held the long prefix (all but the last partial page).
        assert r.usage.prompt_tokens_details.cached_tokens >= (n_long // 16 - 1) * 16
    after = await metric(cluster.url, "tandem:router_expected_cached_pages_total")
    assert after - before >= 3 * (n_long // 16 - 1)


async def test_unrelated_long_prompts_spread_over_prefill_workers(cluster, c):
    before = {w: await metric(cluster.url, "tandem:router_decisions_total", worker=w,
                              role="prefill") for w in ("p1", "p2")}  # fmt: skip
    prompts = [f"Story {k}. " + LONG.replace("river", f"road{k}") for k in range(4)]
    await asyncio.gather(*(c.completions.create(model="default", prompt=p, max_tokens=1)
                           for p in prompts))  # fmt: skip
    for w in ("p1", "p2"):
        after = await metric(cluster.url, "tandem:router_decisions_total", worker=w,
                             role="prefill")  # fmt: skip
        assert after > before[w], f"{w} got none of 4 concurrent unrelated prompts"


async def test_64_concurrent_streams_all_complete_with_exact_usage(cluster, tokenizer, c):

    async def one(i: int) -> None:
        prompt = f"Count from {i} to {i + 5}:"
        stream = await c.completions.create(
            model="default", prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        usage, finish = None, None
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length"
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            len(tokenizer.encode(prompt)), 8)  # fmt: skip

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=240)


async def test_client_disconnect_cancels_the_request_on_the_workers(cluster, module_nats):
    nc = await nats.connect(module_nats.url)
    cancels: list[CancelRequest] = []
    running: list[int] = []

    async def on_cancel(msg) -> None:
        cancels.append(CancelRequest.decode(msg.data))

    async def on_load(msg) -> None:
        running.append(LoadReport.decode(msg.data).running)

    await nc.subscribe("tandem.cancel", cb=on_cancel)
    await nc.subscribe("tandem.workers.decode.d1.load", cb=on_load)
    await settle(nc)  # the router and d1 publish on their own connections
    body = {"model": "default", "prompt": "Tell a long story.", "max_tokens": 1000,
            "stream": True, "ignore_eos": True}  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{cluster.url}/v1/completions", json=body,
                                   headers={"x-request-id": "disconnect-1"})  # fmt: skip
            events = 0
            async for line in resp.content:
                events += line.startswith(b"data: ")
                if events >= 3:
                    break
            resp.close()  # the client goes away mid-stream
        assert await until(lambda: cancels, 10)
        # Keyed by (router instance, router-local id): the client's id is only a label.
        assert cancels[-1].router and cancels[-1].request_id != "disconnect-1"
        running.clear()
        # Long before 1000 tokens could be done, the decode worker runs nothing.
        assert await until(lambda: running and running[-1] == 0, 10)
    finally:
        await nc.close()


async def until(predicate, timeout: float, step: float = 0.1) -> bool:
    for _ in range(int(timeout / step)):
        if predicate():
            return True
        await asyncio.sleep(step)
    return bool(predicate())


async def test_queue_bound_429_and_router_restart_rebuilds_the_index(cluster, module_nats,
                                                                      tmp_path):  # fmt: skip
    routers = Routers(module_nats.url, tmp_path)
    try:
        url = await routers.astart("router-b", "--max-pending", "1", "--disagg-threshold", "32")
        first = await wait_healthy(url, {"prefill": 2, "decode": 1}, 60)
        assert first["kv_index_replayed"] and first["kv_index_keys"] > 0  # earlier tests' events
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=240)
        # Earlier tests may have pushed the long prefix out of the workers' LRU caches:
        # compute it once more, so that a prefill worker surely holds it at the restart.
        await c.completions.create(model="default", prompt=f"{LONG} Q8", max_tokens=1)
        await asyncio.sleep(1.0)  # its KV events reach the stream the next router replays
        hold = asyncio.create_task(
            c.completions.create(
                model="default", prompt="Hello", max_tokens=200, extra_body={"ignore_eos": True}
            )
        )
        await asyncio.sleep(1.0)
        with pytest.raises(openai.RateLimitError) as e:
            await c.completions.create(model="default", prompt="Hello", max_tokens=1)
        assert e.value.response.headers["Retry-After"] == "1"
        await hold
        await c.close()
        keys = (await wait_healthy(url, {"prefill": 2, "decode": 1}, 10))["kv_index_keys"]
        routers.stop()  # restart: a fresh process, same id, must route as well as before
        url = await routers.astart("router-b", "--disagg-threshold", "32")
        again = await wait_healthy(url, {"prefill": 2, "decode": 1}, 60)
        assert again["kv_index_replayed"] and again["kv_index_keys"] >= keys * 0.9
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        r = await c.completions.create(model="default", prompt=f"{LONG} Q9", max_tokens=1)
        await c.close()
        assert r.usage.prompt_tokens_details.cached_tokens > 256
        assert await metric(url, "tandem:router_expected_cached_pages_total") > 16
    finally:
        routers.stop()


async def test_paused_worker_leaves_rotation_within_3s_and_requests_still_succeed(cluster, c):
    pid = cluster.cluster.procs["p2"].pid
    os.kill(pid, signal.SIGSTOP)  # stops reporting (and serving) without exiting
    try:
        started = time.monotonic()
        # Some of these may be routed to p2 before it is dropped: they must be retried.
        prompts = [f"Topic {k}. " + LONG.replace("sea", f"lake{k}") for k in range(3)]
        results = await asyncio.gather(
            *(c.completions.create(model="default", prompt=p, max_tokens=1) for p in prompts)
        )
        assert all(r.choices[0].finish_reason for r in results)
        body = await wait_healthy(cluster.url, {"prefill": 1}, 10)
        deadline = started + 4.0
        while body["workers"]["prefill"] != 1 and time.monotonic() < deadline:
            body = await wait_healthy(cluster.url, {"prefill": 1}, 1)
        assert body["workers"]["prefill"] == 1
    finally:
        os.kill(pid, signal.SIGCONT)
