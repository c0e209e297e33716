"""bench.router's lean HTTP client against a real aiohttp server: every SSE event, in
order, each stamped no earlier than it was sent; keep-alive reuses the connection."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from bench.http_stream import LeanClient
from tests.http_server import serve_http


async def handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    response = web.StreamResponse(headers={"x-request-id": request.headers["x-request-id"]})
    await response.prepare(request)
    for i in range(body["n"]):
        await response.write(b'data: {"i": %d, "t": %r}\n\n' % (i, time.monotonic()))
        await asyncio.sleep(0.01)
    await response.write_eof(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def port():
    async with serve_http("/v1/completions", handler) as port:
        yield port


async def test_every_event_arrives_in_order_stamped_after_it_was_sent(port):
    client = LeanClient("127.0.0.1", port)
    try:
        for _ in range(2):  # the second request reuses the kept-alive connection
            start, events = await client.stream("/v1/completions", {"n": 5}, {"x-request-id": "a"})
            assert [e for e, _ in events][-1] == b"[DONE]"
            sent = [float(e.split(b'"t": ')[1].rstrip(b"}")) for e, _ in events[:-1]]
            seen = [t for _, t in events[:-1]]
            assert len(sent) == 5 and all(t >= s >= start for s, t in zip(sent, seen, strict=True))
        assert len(client.idle) == 1
    finally:
        client.close()
