"""The worst input of each kind through a real router (and one real `--role both`
worker): refused by its limit, or served, while a /health poll beside it (every 15 ms,
from a process and a connection of its own) waits under 100 ms (p99; none over 0.5 s):
nothing proportional to the input runs on the router's event loop (admission/budget.py,
formats/bodies.py, api/render.py, requests/lifecycle.py)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from bench.deployments import Deployment, Topology
from services.router.config import RouterConfig

pytestmark = pytest.mark.slow

IDS_LIMIT = 256
# n 8 x max_tokens 16 x (1 + top 20) logprob values: the heavy request served at the limit
LOGPROB_LIMIT = 8 * 16 * 21
BODY_LIMIT = RouterConfig().max_body_bytes  # the default
HEALTH_BOUND = 0.1  # seconds a /health answer may take (p99), whatever else the router does
STALL = 0.5  # seconds no /health answer may take


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[str]:
    worker = ["--num-threads", "1", "--kv-cache-mb", "64", "--transport", "tcp",
              "--no-pool", "true"]  # fmt: skip
    flags = ["--max-prompt-ids", str(IDS_LIMIT), "--max-logprob-values", str(LOGPROB_LIMIT)]
    topo = Topology("budget", 0, 0, worker, router_args=flags, both=1)
    deployment = Deployment(topo, tmp_path_factory.mktemp("budget"))
    try:
        asyncio.run(deployment.start(timeout=240))
        yield deployment.url.removesuffix("/v1")
    finally:
        deployment.stop()


# The poller: its own process (the test's own work must not hold its GIL), one keep-alive
# connection, GET /health every 15 ms; "ready" after the first answer; stops at EOF on
# stdin once it has 3 answers (or after 120 s or 8000 polls); prints every wait as JSON.
POLL = """
import http.client, json, select, sys, time
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=10)
waits, deadline = [], time.monotonic() + 120
while len(waits) < 8000 and time.monotonic() < deadline:
    start = time.perf_counter()
    conn.request("GET", "/health")
    conn.getresponse().read()
    waits.append(time.perf_counter() - start)
    if len(waits) == 1:
        print("ready", flush=True)
    if select.select([sys.stdin], [], [], 0.015)[0] and len(waits) >= 3:
        break
print(json.dumps(waits), flush=True)
"""


class HealthPoll:
    """GET /health every 15 ms from a process of its own while the block runs;
    `waits` holds each answer's time."""

    def __init__(self, url: str):
        self.address = urlsplit(url)
        self.waits: list[float] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> HealthPoll:
        args = [sys.executable, "-c", POLL, str(self.address.hostname), str(self.address.port)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        try:
            out, _ = self.proc.communicate(timeout=30)  # closes stdin: the poller stops
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.waits = json.loads(out)

    def check(self) -> None:
        """The p99 wait under HEALTH_BOUND (the issue's figure), and none over STALL: on
        this shared 2-core host one poll in a few hundred may wait for a core, not for
        the router's loop (the stalls fixed here were 0.75 to 4 s)."""
        waits = sorted(self.waits)
        p99 = waits[int(len(waits) * 0.99)] if waits else float("nan")
        print(f"\n/health beside it: {len(waits)} polls, p99 {p99 * 1000:.1f} ms, "
              f"max {waits[-1] * 1000 if waits else float('nan'):.1f} ms")  # fmt: skip
        assert len(waits) >= 3, waits
        assert p99 < HEALTH_BOUND, waits[-5:]
        assert waits[-1] < STALL, waits[-5:]


async def post(url: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as http:
        async with http.post(f"{url}{path}", data=data, headers=headers) as r:
            return r.status, await r.json()


def error(out: dict, param: str | None, *words: str) -> dict:
    e = out["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["param"] == param, e
    for word in words:
        assert word in e["message"], e
    return e


async def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(router):
    host, port = urlsplit(router).hostname, urlsplit(router).port
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {BODY_LIMIT + 1}\r\n\r\n").encode()  # fmt: skip
    with HealthPoll(router) as poll:
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + b'{"model": "default", "prompt": "')  # and nothing more
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        took = time.perf_counter() - start
        length = int(next(h.split(b":")[1] for h in headers.split(b"\r\n")
                          if h.lower().startswith(b"content-length")))  # fmt: skip
        out = orjson.loads(await asyncio.wait_for(reader.readexactly(length), 30))
        writer.close()
    assert status_line.split()[1] == b"413", status_line
    error(out, None, str(BODY_LIMIT), "--max-body-bytes")
    assert took < 5, took  # answered without the 16 MiB it announced
    poll.check()


async def test_a_chunked_body_over_the_limit_is_413(router):
    async def chunks():
        for _ in range(BODY_LIMIT // (1 << 20) + 1):
            yield b" " * (1 << 20)

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{router}/v1/completions", data=chunks()) as r:
            assert r.status == 413
            error(await r.json(), None, "--max-body-bytes")


def ids_body(n: int) -> bytes:
    return b'{"model": "default", "max_tokens": 1, "prompt": [' + b"0," * (n - 1) + b"0]}"


async def test_an_8m_id_prompt_is_refused_before_it_is_decoded(router):
    body = ids_body(8_000_000)
    assert len(body) < BODY_LIMIT
    with HealthPoll(router) as poll:
        start = time.perf_counter()
        status, out = await post(router, "/v1/completions", body)
        took = time.perf_counter() - start
    assert status == 400
    error(out, None, str(RouterConfig().max_body_items), "--max-body-items")
    assert took < 10, took  # refused once the commas read pass the limit
    poll.check()


async def test_a_prompt_of_ids_past_the_ids_limit_is_refused(router):
    body = ids_body(RouterConfig().max_body_items - 8)  # decoded: the most items allowed
    with HealthPoll(router) as poll:
        status, out = await post(router, "/v1/completions", body)
    assert status == 400
    error(out, "prompt", str(RouterConfig().max_body_items - 8), "--max-prompt-ids")
    poll.check()


async def test_a_prompt_at_the_ids_limit_is_served(router):
    prompt = [1 + i % 500 for i in range(IDS_LIMIT)]
    body = {"model": "default", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    status, out = await post(router, "/v1/completions", body)
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == IDS_LIMIT and out["usage"]["completion_tokens"] == 2
    status, out = await post(router, "/v1/completions", {**body, "prompt": [*prompt, 7]})
    assert status == 400
    error(out, "prompt", str(IDS_LIMIT + 1), "--max-prompt-ids")


HEAVY = {"model": "default", "messages": [{"role": "user", "content": "Count to ten."}],
         "n": 8, "max_tokens": 16, "logprobs": True, "top_logprobs": 20, "ignore_eos": True,
         "temperature": 1.0}  # fmt: skip


async def test_logprob_values_over_the_limit_are_refused(router):
    status, out = await post(router, "/v1/chat/completions", {**HEAVY, "max_tokens": 17})
    assert status == 400
    error(out, "top_logprobs", str(8 * 17 * 21), str(LOGPROB_LIMIT), "--max-logprob-values")


async def test_a_logprobs_heavy_request_at_the_limit_is_served(router):
    with HealthPoll(router) as poll:
        status, out = await post(router, "/v1/chat/completions", HEAVY)
    assert status == 200, out
    assert len(out["choices"]) == 8
    for choice in out["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 16 and all(len(c["top_logprobs"]) == 20 for c in content)
        # The tokens' texts make the content, less special tokens (ignore_eos runs past
        # <|im_end|>) and unless a token alone splits a character.
        text = re.sub(r"<\|[a-z_]+\|>", "", "".join(c["token"] for c in content))
        assert text == choice["message"]["content"] or "\ufffd" in text, (text, choice)
    poll.check()


async def test_64_concurrent_renders_of_2000_messages_leave_the_loop_free(router):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
                for i in range(2000)]  # fmt: skip
    body = orjson.dumps({"messages": messages})
    with HealthPoll(router) as poll:
        results = await asyncio.gather(*(post(router, "/v1/chat/render", body) for _ in range(64)))
    assert {status for status, _ in results} == {200}
    prompts = {out["prompt"] for _, out in results}
    assert len(prompts) == 1 and "message 1999" in prompts.pop()
    poll.check()


async def test_64_concurrent_chats_of_2000_messages_leave_the_loop_free(router):
    """Each rendered and tokenized (~22K tokens), then refused past the context."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
                for i in range(2000)]  # fmt: skip
    body = orjson.dumps({"model": "default", "messages": messages, "max_tokens": 1})
    with HealthPoll(router) as poll:
        results = await asyncio.gather(
            *(post(router, "/v1/chat/completions", body) for _ in range(64))
        )
    assert {status for status, _ in results} == {400}
    for _, out in results:
        error(out, "messages", "maximum context length")
    poll.check()


def test_the_poll_sees_a_stalled_server(tmp_path):
    """HealthPoll can fail: a server that answers /health after 150 ms is caught."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(4096):
                time.sleep(0.15)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with HealthPoll(f"http://127.0.0.1:{port}") as poll:
        time.sleep(0.6)
    server.close()
    with pytest.raises(AssertionError):
        poll.check()
