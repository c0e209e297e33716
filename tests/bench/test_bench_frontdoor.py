"""bench.frontdoor's own arithmetic and clients, against small servers with known behaviour:
the counts it reports must be the servers' own."""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from bench import frontdoor, frontdoor_load
from bench.frontdoor_cases import hold_slow_sockets


def test_window_takes_the_polls_that_overlap_it():
    polls = [(0.0, 0.010), (1.0, 0.200), (2.0, 0.005), (3.0, 0.050)]
    w = frontdoor.window(polls, 0.9, 2.5)  # the poll at 1.0 and the one at 2.0
    assert w["polls"] == 2
    assert w["max_ms"] == 200.0
    assert frontdoor.window(polls, 5.0, 6.0)["polls"] == 0


def test_verdicts_fail_on_a_5xx_a_slow_health_a_wrong_stream_or_an_open_socket():
    good = {"statuses": [400], "health": {"p99_ms": 20.0}, "streams_ok": True}
    res = {
        "hostile": {"a": good, "b": {**good, "streams_ok": False},
                    "c": {**good, "health": {"p99_ms": 150.0}},
                    "d": {**good, "statuses": [401, 500]},
                    "e": {**good, "statuses": [], "opened": 10, "closed_by_router": 9}},
        "overload": {"4x": {"refused_429": 3, "refused_max_ms": 60.0},
                     "goodput_2x_over_1x": 0.95, "goodput_4x_over_1x": 0.5},
    }  # fmt: skip
    v = frontdoor.verdicts(res)
    health = [v[k] for k in sorted(v) if k[0] in "abcde" and "p99" in k]
    assert health == [True, False, False, False, True]
    assert v["e: every socket closed by the router"] is False
    assert v["4x: excess refused, each 429 within 50 ms"] is False
    assert v["2x goodput >= 90% of 1x"] is True
    assert v["4x goodput >= 90% of 1x"] is False
    res["overload"]["4x"] = {"refused_429": 0, "refused_max_ms": None}  # none refused: not met
    assert frontdoor.verdicts(res)["4x: excess refused, each 429 within 50 ms"] is False


class Limited:
    """Streams `max_tokens` words; answers 429 at once beyond `capacity` streams."""

    def __init__(self, capacity: int):
        self.capacity, self.running, self.served, self.refused = capacity, 0, 0, 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.running >= self.capacity:
            self.refused += 1
            return web.json_response({"error": {"message": "busy"}}, status=429,
                                     headers={"Retry-After": "0.05"})  # fmt: skip
        self.running += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.01)
                choice = {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}
                await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            self.served += 1
            return resp
        finally:
            self.running -= 1


async def test_overload_counts_what_the_server_served_and_refused():
    server = Limited(capacity=2)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        res = await frontdoor_load.overload(f"http://127.0.0.1:{port}/v1", "m", {}, capacity=2,
                                       seconds=1.0, ttft_slo=5.0, max_tokens=3)  # fmt: skip
    finally:
        await runner.cleanup()
    levels = [res[k] for k in ("1x", "2x", "4x")]
    assert sum(lv["served"] for lv in levels) == server.served
    assert sum(lv["refused_429"] for lv in levels) == server.refused
    assert levels[0]["refused_429"] == 0  # at capacity nobody is refused
    assert levels[2]["refused_429"] > 0 and levels[2]["refused_max_ms"] is not None
    assert all(lv["failed"] == 0 for lv in levels)
    assert res["goodput_2x_over_1x"] > 0


async def _server(close_after: float | None) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if close_after is None:
            await reader.read()  # holds the socket until the client goes
        else:
            await asyncio.sleep(close_after)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_slow_sockets_count_what_the_server_closed():
    closing, port = await _server(close_after=0.3)
    holding, port2 = await _server(close_after=None)
    try:
        t0 = time.monotonic()
        closed = await hold_slow_sockets("127.0.0.1", port, 9, 2.0, "Bearer k")
        held = await hold_slow_sockets("127.0.0.1", port2, 9, 1.5, "Bearer k")
        assert time.monotonic() - t0 < 15
    finally:
        closing.close()
        holding.close()
    assert closed["opened"] == 9 and closed["closed_by_router"] == 9
    assert closed["last_closed_s"] is not None and closed["last_closed_s"] < 2.0
    assert held["opened"] == 9 and held["closed_by_router"] == 0
