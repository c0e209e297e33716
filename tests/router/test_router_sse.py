"""SSE (services/router/formats/sse.py): the framing of one event, and SseStream on a real
aiohttp server and real sockets: events written from synchronous callbacks arrive whole
and in order, over HTTP/1.1 (chunked) and HTTP/1.0 (raw)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from services.router.formats.sse import DONE, ClientGone, SseStream, parse_sse, sse
from tests.http_server import serve_http

EVENTS = [{"i": i, "text": "a\nb" * i} for i in range(20)]


def test_sse_event_is_one_data_line_even_with_newlines_in_text():
    raw = sse({"text": "a\nb\r\n\n"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n") == 2
    assert parse_sse(raw + DONE) == [{"text": "a\nb\r\n\n"}, "[DONE]"]


def test_done_terminates_the_stream_as_openai_does():
    assert DONE == b"data: [DONE]\n\n"


async def handler(request: web.Request) -> web.StreamResponse:
    out = SseStream(request, {"x-request-id": "r1"})
    loop = asyncio.get_running_loop()
    for i, event in enumerate(EVENTS):  # as bus callbacks would: plain calls on the loop
        loop.call_later(0.002 * (i // 5), out.send, sse(event))
    await asyncio.sleep(0.05)
    return await out.finish(sse({"usage": 1}) + DONE)


@pytest.fixture
async def url():
    async with serve_http("/s", handler) as port:
        yield f"http://127.0.0.1:{port}/s", port


async def test_events_arrive_whole_and_in_order_over_chunked_http11(url):
    async with aiohttp.ClientSession() as http, http.post(url[0]) as resp:
        assert resp.headers["x-request-id"] == "r1"
        assert resp.headers["Transfer-Encoding"] == "chunked"
        body = await resp.read()
    assert parse_sse(body) == [*EVENTS, {"usage": 1}, "[DONE]"]


async def test_events_arrive_whole_over_http10_without_chunking(url):
    reader, writer = await asyncio.open_connection("127.0.0.1", url[1])
    writer.write(b"POST /s HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    raw = await reader.read()  # HTTP/1.0: the body ends with the connection
    writer.close()
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    assert parse_sse(body) == [*EVENTS, {"usage": 1}, "[DONE]"]


async def test_send_after_the_client_left_raises_client_gone():
    gone: asyncio.Future = asyncio.get_running_loop().create_future()

    async def leaving(request: web.Request) -> web.StreamResponse:
        out = SseStream(request, {})
        out.send(sse({"i": 0}))
        await out.opening
        request.transport.close()  # as when the client's side of the socket goes away
        await asyncio.sleep(0.01)
        try:
            out.send(sse({"i": 1}))
        except ClientGone as e:
            gone.set_result(e)
        raise ConnectionResetError

    async with serve_http("/s", leaving) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            assert isinstance(await asyncio.wait_for(gone, 5), ClientGone)
