"""Token chunks lost in transit (a restarted nats-server drops what it held) while every
worker is live: after `lost_after` the dispatcher continues the request after the tokens
the client has (migration), or ends it; it never waits forever."""

from __future__ import annotations

import time

import pytest

from services.router.errors import ApiError
from tests.router.test_router_dispatch import chunk, collect, route_to, setup


async def test_a_hole_in_the_chunk_order_is_continued_after_the_tokens_before_it(nats_url):
    def script(rid):  # chunk 1 never arrives the first time; the continuation is whole
        if rid == "r1":
            return [chunk(rid, 0, [1]), chunk(rid, 2, [3]), chunk(rid, 3, [], "length")]
        return [chunk(rid, 1, [2]), chunk(rid, 2, [3]), chunk(rid, 3, [], "length")]

    async with setup(nats_url, {"d1": script}) as (dispatcher, resp, _, _):
        dispatcher.lost_after = 0.5
        out = await collect(dispatcher, route_to("d1"), timeout=30.0)
    assert [t for c in out for t in c.token_ids] == [1, 2, 3]
    assert resp[0].requests[1].generated == [1]


async def test_a_hole_on_every_attempt_ends_the_stream_in_bounded_time(nats_url):
    def script(rid):  # chunk 1 never arrives; the rest, the final one included, does
        return [chunk(rid, 0, [1]), chunk(rid, 2, [3]), chunk(rid, 3, [], "length")]

    async with setup(nats_url, {"d1": script}) as (dispatcher, _, _, _):
        dispatcher.lost_after = 0.3
        started = time.monotonic()
        with pytest.raises(ApiError) as e:
            await collect(dispatcher, route_to("d1"), timeout=30.0)
    assert e.value.status == 502 and "lost in transit" in e.value.message
    assert time.monotonic() - started < 4  # 1 + 3 continuations, each lost_after + a sweep


async def test_a_lost_first_chunk_is_retried_on_another_worker(nats_url):
    def lossy(rid):
        return [chunk(rid, 1, [2]), chunk(rid, 2, [], "length")]

    def good(rid):
        return [chunk(rid, 0, [7], "stop")]

    async with setup(nats_url, {"d1": lossy, "d2": good}) as (dispatcher, resp, _, _):
        dispatcher.lost_after = 0.5
        out = await collect(dispatcher, route_to("d1", "d2"), timeout=30.0)
    assert out[-1].token_ids == [7] and resp[1].seen == ["r1-r1"]
