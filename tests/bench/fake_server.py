"""A tiny OpenAI-compatible streaming server with known delays, to check bench.serve's numbers.

Real HTTP and real SSE on 127.0.0.1 (a random port), in the test's own event loop. Each
request waits `ttft` before its first token, then `itl` between tokens, and emits exactly
`max_tokens` tokens of one word each. Usage: prompt_tokens = words of all messages;
cached_tokens = words of all messages but the last (what a perfect prefix cache would
hit). The server records what it saw and what it answered, so tests compare the tool's
results against the server's own totals and its own clock (the same process, the same
`perf_counter`), which stays right when a loaded machine stretches the sleeps.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class Seen:
    body: dict[str, Any]
    start: float
    end: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)


@dataclass
class FakeServer:
    """Serves /v1/models and streaming /v1/chat/completions and /v1/completions."""

    ttft: float = 0.1
    itl: float = 0.02
    fail_every: int = 0  # every n-th request answers HTTP 500 (0: never)
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    async def __aenter__(self) -> FakeServer:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        # A client that goes away cancels its handler, as a real server cancels the request.
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen = Seen(body, time.perf_counter())
        self.seen.append(seen)
        if self.fail_every and len(self.seen) % self.fail_every == 0:
            seen.end = time.perf_counter()
            return web.json_response({"error": {"message": "injected"}}, status=500)
        if "messages" in body:
            texts = [m["content"] for m in body["messages"]]
        else:
            texts = [body["prompt"]]
        seen.prompt_tokens = sum(len(t.split()) for t in texts)
        seen.cached_tokens = sum(len(t.split()) for t in texts[:-1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        await asyncio.sleep(self.ttft)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl)
            if "messages" in body:
                choice = {"index": 0, "delta": {"content": f" w{i}"}}
            else:
                choice = {"index": 0, "text": f" w{i}"}
            await self._send(resp, {"choices": [choice]})
            seen.token_times.append(time.perf_counter())
        usage = {
            "prompt_tokens": seen.prompt_tokens, "completion_tokens": n,
            "total_tokens": seen.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": seen.cached_tokens},
        }  # fmt: skip
        await self._send(resp, {"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        seen.end = time.perf_counter()
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")
