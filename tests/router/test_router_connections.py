"""The router's connection limits (services/router/api/connections.py and
connection_middleware.py), each alone, on real sockets against a real aiohttp server with
the router's middlewares and listener: short timeouts so each case takes about a second.
tests/hostile/test_slow_connections.py holds 1,000 such sockets against a real router and
workers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator

import orjson
import pytest
import uvloop
from aiohttp import web

from services.router.api import connection_middleware as middleware
from services.router.api.connections import ConnectionLimits, Listener
from services.router.config import RouterConfig
from services.router.errors import ApiError

LIMITS = ConnectionLimits(
    keepalive_timeout=1.0,
    header_timeout=0.5,
    body_timeout=0.5,
    send_timeout=0.5,
    max_header_bytes=2048,
    max_headers=16,
    max_connections=6,
    max_connections_per_address=3,
)
BOUND_S = 5.0  # no read in these tests may wait longer


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """The router's app.py middleware in short: an ApiError becomes its JSON body."""
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


async def _hello(request: web.Request) -> web.Response:
    return web.Response(text="hello")


MIB = 1 << 20


async def _big(request: web.Request) -> web.StreamResponse:
    """?mib= MiB, a MiB a write."""
    response = web.StreamResponse()
    response.content_length = int(request.query["mib"]) * MIB
    await response.prepare(request)
    for _ in range(int(request.query["mib"])):
        await response.write(b"x" * MIB)
    await response.write_eof()
    return response


@contextlib.asynccontextmanager
async def _serving(refused: Counter[str] | None = None) -> AsyncIterator[int]:
    """A real aiohttp server with the router's middlewares and listener; its port. The
    listener counts its refusals into `refused`, by limit."""
    counts = Counter[str]() if refused is None else refused
    app = web.Application(middlewares=[middleware.track, _errors, middleware.read_body])
    middleware.install(app, LIMITS)
    app.router.add_post("/echo", _echo)
    app.router.add_get("/hello", _hello)
    app.router.add_get("/big", _big)
    runner = web.AppRunner(app, access_log=None, **LIMITS.runner_options())
    await runner.setup()
    assert runner.server is not None
    listener = Listener(runner.server, LIMITS, lambda limit: counts.update([limit]))
    try:
        yield await listener.start("127.0.0.1", 0)
    finally:
        listener.close()
        await runner.cleanup()


@pytest.fixture
def refused() -> Counter[str]:
    return Counter()


@pytest.fixture
async def port(refused: Counter[str]) -> AsyncIterator[int]:
    async with _serving(refused) as port:
        yield port


async def _open(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One whole response (status, body), read within BOUND_S."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
    lines = head.decode().split("\r\n")
    length = next(int(ln.split(":")[1]) for ln in lines if ln.lower().startswith("content-length"))
    body = await asyncio.wait_for(reader.readexactly(length), BOUND_S)
    return int(lines[0].split()[1]), body


async def _eof_after(reader: asyncio.StreamReader) -> float:
    """Seconds until the server closes the connection (what is left unread is dropped)."""
    start = time.monotonic()
    while await asyncio.wait_for(reader.read(65536), BOUND_S):
        pass
    return time.monotonic() - start


def _get(path: str = "/hello", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


async def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(port, refused):
    reader, writer = await _open(port)
    start = time.monotonic()
    data = await asyncio.wait_for(reader.read(), BOUND_S)
    waited = time.monotonic() - start
    writer.close()
    assert data == b""
    assert LIMITS.header_timeout - 0.1 <= waited < LIMITS.header_timeout + 1.0
    assert refused == {"header_timeout": 1}


async def test_dripped_headers_get_408_at_the_header_timeout(port):
    reader, writer = await _open(port)
    writer.write(b"GET /hello HTTP/1.1\r\n")

    async def drip():  # a byte every 50 ms, never the blank line
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.05)

    start = time.monotonic()
    dripping = asyncio.create_task(drip())
    status, body = await _response(reader)
    waited = time.monotonic() - start
    await _eof_after(reader)
    dripping.cancel()
    writer.close()
    assert status == 408
    assert "--header-timeout" in orjson.loads(body)["error"]["message"]
    assert waited < LIMITS.header_timeout + 1.0


async def test_a_header_block_over_max_header_bytes_gets_431(port, refused):
    reader, writer = await _open(port)
    writer.write(_get(extra=f"X-Big: {'a' * LIMITS.max_header_bytes}\r\n"))
    status, body = await _response(reader)
    writer.close()
    error = orjson.loads(body)["error"]
    assert status == 431 and "--max-header-bytes" in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert refused == {"max_header_bytes": 1}


async def test_a_client_still_sending_a_huge_header_reads_the_431_not_a_reset(port):
    reader, writer = await _open(port)
    writer.write(_get(extra=f"Authorization: Bearer {'k' * 200_000}\r\n"))
    status, body = await _response(reader)
    writer.close()
    assert status == 431 and "--max-header-bytes" in orjson.loads(body)["error"]["message"]


async def test_more_header_lines_than_max_headers_get_431(port, refused):
    reader, writer = await _open(port)
    lines = "".join(f"X-{i}: v\r\n" for i in range(LIMITS.max_headers + 1))
    writer.write(_get(extra=lines))
    status, body = await _response(reader)
    writer.close()
    assert status == 431 and "--max-headers" in orjson.loads(body)["error"]["message"]
    assert refused == {"max_headers": 1}


async def test_max_headers_header_lines_are_served(port):
    reader, writer = await _open(port)
    lines = "".join(f"X-{i}: v\r\n" for i in range(LIMITS.max_headers - 1))  # + Host
    writer.write(_get(extra=lines))
    assert await _response(reader) == (200, b"hello")
    writer.close()


async def test_a_stalled_body_gets_408_and_the_connection_closes(port):
    reader, writer = await _open(port)
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n" + b"a" * 1024
    )
    status, body = await _response(reader)
    assert status == 408
    assert "--body-timeout" in orjson.loads(body)["error"]["message"]
    assert await _eof_after(reader) < 1.0
    writer.close()


async def test_a_body_is_read_once_and_handlers_see_it_whole(port):
    reader, writer = await _open(port)
    payload = bytes(range(256)) * 64
    writer.write(
        f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
    )
    writer.write(payload)
    assert await _response(reader) == (200, payload)
    writer.close()


async def test_an_idle_keep_alive_connection_outlives_the_header_timeout_not_keepalive(port):
    reader, writer = await _open(port)
    writer.write(_get())
    assert await _response(reader) == (200, b"hello")
    # Idle past the header timeout, inside the keep-alive one: the next request is served.
    await asyncio.sleep(LIMITS.header_timeout + 0.2)
    writer.write(_get())
    assert await _response(reader) == (200, b"hello")
    closed_after = await _eof_after(reader)  # then nothing: keep-alive closes it
    writer.close()
    assert LIMITS.keepalive_timeout - 0.2 <= closed_after < LIMITS.keepalive_timeout + 2.0


async def test_a_client_that_stops_reading_is_cut_after_the_send_timeout(port, refused):
    _, writer = await _open(port)
    writer.write(_get("/big?mib=256"))  # far more than the sockets' buffers; never read
    start = time.monotonic()
    for _ in range(100):  # the server aborts; its handler ends (bounded: 100 x 0.1 s)
        if refused:
            break
        await asyncio.sleep(0.1)
    waited = time.monotonic() - start
    writer.close()
    assert refused == {"send_timeout": 1}
    assert LIMITS.send_timeout <= waited < LIMITS.send_timeout + 5


async def test_a_slow_but_steady_reader_gets_the_whole_answer(port, refused):
    reader, writer = await _open(port)
    writer.write(_get("/big?mib=16"))
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
    got = 0
    while got < 16 * MIB:  # a MiB, then a pause well under the send timeout
        got += len(await asyncio.wait_for(reader.readexactly(MIB), BOUND_S))
        await asyncio.sleep(LIMITS.send_timeout / 5)
    writer.close()
    assert got == 16 * MIB and "send_timeout" not in refused


async def _served(port: int, source: str):
    reader, writer = await _open(port, source)
    writer.write(_get())
    assert await _response(reader) == (200, b"hello")
    return writer


async def test_one_connection_over_the_per_address_cap_gets_429_and_others_are_served(port):
    held = [await _served(port, "127.0.0.1") for _ in range(LIMITS.max_connections_per_address)]
    reader, writer = await _open(port, "127.0.0.1")
    status, body = await _response(reader)
    assert status == 429 and "--max-connections-per-address" in body.decode()
    assert await _eof_after(reader) < 2.0
    writer.close()
    other = await _served(port, "127.0.0.2")  # another address still gets in
    held[0].close()
    await held[0].wait_closed()
    for _ in range(50):  # the freed slot is reused (the server sees the close soon after)
        reader, writer = await _open(port, "127.0.0.1")
        writer.write(_get())
        status, _ = await _response(reader)
        writer.close()
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200
    for w in [*held[1:], other]:
        w.close()


async def test_one_connection_over_the_total_cap_gets_503(port, refused):
    per = LIMITS.max_connections_per_address
    sources = [f"127.0.0.{2 + i // per}" for i in range(LIMITS.max_connections)]
    held = [await _served(port, source) for source in sources]
    reader, writer = await _open(port, "127.0.0.99")
    status, body = await _response(reader)
    assert status == 503 and "--max-connections" in body.decode()
    assert refused == {"max_connections": 1}
    writer.close()
    for w in held:
        w.close()


def test_the_limits_hold_under_uvloop_the_routers_default_loop():
    """uvloop's transports are not asyncio's classes: the same cases, on uvloop."""
    refused: Counter[str] = Counter()

    async def cases() -> None:
        async with _serving(refused) as port:
            await test_dripped_headers_get_408_at_the_header_timeout(port)
            await test_a_client_still_sending_a_huge_header_reads_the_431_not_a_reset(port)
            await test_a_stalled_body_gets_408_and_the_connection_closes(port)
            await test_a_body_is_read_once_and_handlers_see_it_whole(port)
            await test_one_connection_over_the_per_address_cap_gets_429_and_others_are_served(port)

    uvloop.run(cases())
    assert refused.keys() == {"header_timeout", "max_header_bytes", "body_timeout",
                              "max_connections_per_address"}, refused  # fmt: skip
    assert refused["header_timeout"] == refused["max_header_bytes"] == 1, refused
    assert refused["body_timeout"] == 1, refused


def test_each_connection_flag_is_checked_and_named():
    assert ConnectionLimits.of(RouterConfig()).max_connections_per_address == 256
    for name in ConnectionLimits.__dataclass_fields__:
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')}"):
            RouterConfig(**{name: 0})
