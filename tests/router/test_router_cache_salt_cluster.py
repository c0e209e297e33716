"""cache_salt end to end (issue 38): tenants' caches kept apart on a real disaggregated
cluster with the pool: nats-server, a cache master and a store, a prefill and a decode
worker (the default model, writing their pages to the pool) and the router, through the
official `openai` client.

A prompt cached under salt A is a hit again under salt A and a miss (0 cached tokens)
under salt B or without a salt, on both endpoints; its pages in the pool are found under
salt A's keys only (a /v1/pins of the same prefix counts the pages present). Slow.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest

from scripts.cluster import REPO, LocalCluster
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import metric, openai_client, wait_healthy

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--num-threads", "1", "--kv-cache-mb", "128", "--transport", "tcp"]
# Every prompt goes through the prefill worker (the disaggregated path).
ROUTER_ARGS = ["--disagg-threshold", "16"]


def text(topic: str) -> str:
    return " ".join(f"Note {i} on {topic}: the ledger of item {i} was audited." for i in range(14))


@pytest.fixture(scope="module")
def cluster(module_nats, tmp_path_factory):
    logs = tmp_path_factory.mktemp("salt-logs")
    local = LocalCluster(module_nats.url, env=router_env(), capture=logs)
    try:
        local.start_one("cache_master", "--service-id", "m1", "--election", "false")
        local.start_one("cache_store", "--service-id", "s1", "--segment-size", "64MiB",
                        "--transport", "tcp", "--heartbeat-interval", "0.3")  # fmt: skip
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            local.start_one(role, "--service-id", sid, *WORKER_ARGS, label=sid)
        local.start_one("router", "--service-id", "router-salt", "--port", "0", *ROUTER_ARGS)
        port = asyncio.run(router_port(module_nats.url, "router-salt", 240))
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url, {"prefill": 1, "decode": 1}, 240, local.procs))
        yield url
    finally:
        local.stop()


@pytest.fixture
async def c(cluster):
    async with openai_client(cluster) as client:
        yield client


async def cached(c, prompt: str, salt: str | None, chat: bool = False) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of one greedy request with `salt`."""
    extra = {} if salt is None else {"cache_salt": salt}
    if chat:
        r = await c.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}], max_tokens=2,
            temperature=0, extra_body=extra,
        )  # fmt: skip
    else:
        r = await c.completions.create(
            model="default", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
    details = r.usage.prompt_tokens_details
    return r.usage.prompt_tokens, details.cached_tokens if details else 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_salt_b_gets_no_cached_token_of_a_prompt_salt_a_cached(cluster, c, chat):
    prompt = text("chat" if chat else "completions")
    n, _ = await cached(c, prompt, "tenant-a", chat)
    assert n >= 128  # several pages: a hit would be visible
    # A hit (on whichever worker holds the pages: the decode worker may prefill the few
    # uncached tokens itself) for the same salt.
    _, again = await cached(c, prompt, "tenant-a", chat)
    assert again >= n - 2 * 16, (n, again)  # all but the last (partial) pages
    prefilled = await metric(cluster, "tandem:router_decisions_total", role="prefill")
    assert await cached(c, prompt, "tenant-b", chat) == (n, 0)
    assert await cached(c, prompt, None, chat) == (n, 0)
    # Both misses were routed as uncached, through the prefill worker (disaggregated).
    assert await metric(cluster, "tandem:router_decisions_total", role="prefill") == prefilled + 2
    # ...and salt A's cache is still there for salt A.
    assert (await cached(c, prompt, "tenant-a", chat))[1] == again


async def pin(http, url: str, prompt: str, salt: str | None) -> dict:
    """Pin `prompt`'s pages under `salt`'s keys and unpin at once: the pin's reply counts
    the pages the pool holds (`present`); the budget of pins stays free for the next."""
    body = {"prompt": prompt, "ttl_s": 30, **({} if salt is None else {"cache_salt": salt})}
    async with http.post(f"{url}/v1/pins", json=body) as r:
        reply = await r.json()
        assert r.status == 200, reply
    async with http.delete(f"{url}/v1/pins/{reply['id']}") as r:
        assert r.status == 200, await r.text()
    return reply


async def test_the_pool_holds_salt_as_pages_under_salt_as_keys_only(cluster, c):
    prompt = text("the pool")
    await cached(c, prompt, "tenant-a")
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 60
        while (mine := await pin(http, cluster, prompt, "tenant-a"))["present"] == 0:
            assert time.monotonic() < deadline, f"salt A's pages never reached the pool: {mine}"
            await asyncio.sleep(0.5)
        assert mine["present"] == mine["pages"] >= 8, mine
        for other in ("tenant-b", None):
            theirs = await pin(http, cluster, prompt, other)
            assert theirs["pages"] == mine["pages"] and theirs["present"] == 0, (other, theirs)
    # The operator's command pins the salt's pages too.
    cmd = [sys.executable, "-m", "scripts.pin", "--url", cluster, "add", "--text", prompt,
           "--ttl", "5", "--cache-salt", "tenant-a"]  # fmt: skip
    done = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, capture_output=True,
                                   text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["present"] == mine["present"]


async def test_a_bad_salt_is_refused_with_an_openai_error_naming_it(cluster):
    async with aiohttp.ClientSession() as http:
        for path, body in (
            ("/v1/completions", {"model": "default", "prompt": "hi", "cache_salt": ""}),
            ("/v1/pins", {"prompt": "hi", "ttl_s": 5, "cache_salt": "x" * 257}),
        ):
            async with http.post(f"{cluster}{path}", json=body) as r:
                reply = await r.json()
                assert r.status == 400, reply
                assert reply["error"]["param"] == "cache_salt", reply
                assert set(reply["error"]) == {"message", "type", "param", "code"}
