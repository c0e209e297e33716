"""Migration in the dispatcher, on a real nats-server with scripted decode responders: once
the client has tokens, a failed worker's request continues on another live one, after
exactly the tokens the client has, with no duplicate and no gap. Real workers and a real
kill -9 are in tests/chaos/test_migration.py.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from libs.common.bus.connection import HandlerError
from libs.common.messages.control import SamplingSpec
from services.router.errors import ApiError
from tests.router.test_router_dispatch import (
    chunk,
    collect,
    kept_alive,
    report,
    route_to,
    setup,
)


def ids(chunks):
    return [t for c in chunks for t in c.token_ids]


async def test_an_error_after_tokens_continues_on_another_worker_after_them(nats_url):
    def dies(rid):
        return [chunk(rid, 0, [10, 11]), chunk(rid, 2, [12]), chunk(rid, 3, [], "error")]

    def continues(rid):  # numbered from len(generated), as a real worker does
        return [chunk(rid, 3, [13, 14]), chunk(rid, 5, [15], "length")]

    async with setup(nats_url, {"d1": dies, "d2": continues}) as (dispatcher, resp, _, _):
        out = await collect(dispatcher, route_to("d1", "d2"))
    assert ids(out) == [10, 11, 12, 13, 14, 15] and out[-1].finish_reason == "length"
    cont = resp[1].requests[0]
    assert cont.request_id == "r1-r1" and cont.generated == [10, 11, 12]
    assert cont.token_ids == [1, 2, 3] and cont.prefill_worker == ""


async def test_a_continuation_never_repeats_a_token_the_client_has(nats_url):
    def dies(rid):
        return [chunk(rid, 0, [10]), chunk(rid, 1, [11]), chunk(rid, 2, [], "abort")]

    def replays(rid):  # a confused worker that sends the old tokens again: dropped
        return [chunk(rid, 0, [10, 11]), chunk(rid, 2, [12], "stop")]

    async with setup(nats_url, {"d1": dies, "d2": replays}) as (dispatcher, _, _, _):
        out = await collect(dispatcher, route_to("d1", "d2"))
    assert ids(out) == [10, 11, 12]


async def test_a_lone_live_worker_takes_its_failed_request_back_after_the_tokens(nats_url):
    def once(rid):  # fails the first time only (an engine hiccup, a lost reply)
        if rid == "r1":
            return [chunk(rid, 0, [10]), chunk(rid, 1, [], "error")]
        return [chunk(rid, 1, [11], "stop")]

    async with setup(nats_url, {"d1": once}) as (dispatcher, resp, _, _):
        out = await collect(dispatcher, route_to("d1"))
    assert ids(out) == [10, 11] and resp[0].seen == ["r1", "r1-r1"]


async def test_a_lone_worker_failing_every_continuation_is_a_502_after_three(nats_url):
    def dies(rid):
        return [chunk(rid, 0, [10]), chunk(rid, 1, [], "error")]

    async with setup(nats_url, {"d1": dies}) as (dispatcher, resp, _, _):
        with pytest.raises(ApiError) as e:
            await collect(dispatcher, route_to("d1"))
    assert e.value.status == 502 and e.value.code == "worker_failed"
    assert resp[0].seen == ["r1", "r1-r1", "r1-r2", "r1-r3"]


async def test_no_live_decode_worker_left_is_a_502(nats_url):
    def dies(rid):
        return [chunk(rid, 0, [10]), chunk(rid, 1, [], "error")]

    routes = iter([route_to("d1")(set()), None])  # then d1 is gone, and nobody else

    async with setup(nats_url, {"d1": dies}) as (dispatcher, resp, _, _):
        with pytest.raises(ApiError) as e:
            await collect(dispatcher, lambda _exclude: next(routes))
    assert e.value.status == 502 and "worker failed mid-request" in e.value.message
    assert resp[0].seen == ["r1"]


async def test_a_worker_that_stops_reporting_mid_stream_is_migrated_from(nats_url):
    def stalls(rid):
        return [chunk(rid, 0, [10, 11])]  # then silence: its reports stop too

    def continues(rid):
        return [chunk(rid, 2, [12], "stop")]

    async with setup(nats_url, {"d1": stalls, "d2": continues}) as (dispatcher, resp, _, w):
        w.timeout = 0.5
        async with kept_alive(w, "d2"):
            out = await collect(dispatcher, route_to("d1", "d2"))
    assert ids(out) == [10, 11, 12] and resp[1].requests[0].generated == [10, 11]


async def test_unseeded_sampling_keeps_one_seed_across_a_migration(nats_url):
    def dies(rid):
        return [chunk(rid, 0, [10]), chunk(rid, 1, [], "error")]

    def continues(rid):
        return [chunk(rid, 1, [11], "stop")]

    async with setup(nats_url, {"d1": dies, "d2": continues}) as (dispatcher, resp, _, _):
        gen = dispatcher.generate("r1", [1], SamplingSpec(temperature=0.8), route_to("d1", "d2"),
                                  10)  # fmt: skip
        out = [c async for c in gen]
    first, second = resp[0].requests[0].sampling, resp[1].requests[0].sampling
    assert ids(out) == [10, 11] and first.seed is not None and first.seed == second.seed


async def test_a_worker_restarted_under_its_id_is_migrated_from_at_once(nats_url):
    # The new process reports before --worker-timeout: its id stays live, but the request
    # ran on the old process (another LoadReport.instance) and is continued elsewhere.
    def stalls(rid):
        return [chunk(rid, 0, [10, 11])]  # then the process "dies"

    def continues(rid):
        return [chunk(rid, 2, [12], "stop")]

    async with setup(nats_url, {"d1": stalls, "d2": continues}) as (dispatcher, resp, _, w):
        w.update(msgspec.structs.replace(report("d1"), instance="old"))
        task = asyncio.ensure_future(collect(dispatcher, route_to("d1", "d2")))
        await asyncio.sleep(0.5)
        assert not task.done()
        started = time.monotonic()
        w.update(msgspec.structs.replace(report("d1"), instance="new"))
        out = await asyncio.wait_for(task, 5)
    assert ids(out) == [10, 11, 12] and resp[1].requests[0].generated == [10, 11]
    assert time.monotonic() - started < 1  # the next sweep, not --worker-timeout


async def test_a_busy_worker_after_a_failure_is_waited_for_not_counted_as_a_migration(nats_url):
    # A continuation that meets a full worker waits for room (as a new request would),
    # even past --queue-timeout from the request's start: it counts from the failure.
    busy = {"left": 4}

    def stalls(rid):
        return [chunk(rid, 0, [10])]  # then silence, past the queue timeout

    def full_then_continues(rid):
        if busy["left"]:
            busy["left"] -= 1
            raise HandlerError(429, "KV pool full")
        return [chunk(rid, 1, [11], "stop")]

    scripts = {"d1": stalls, "d2": full_then_continues}
    async with setup(nats_url, scripts, queue_timeout=1.0) as (dispatcher, resp, _, w):
        w.timeout = 1.5
        migrated = []
        dispatcher.on_migrated = lambda: migrated.append(1)
        async with kept_alive(w, "d2"):
            out = await collect(dispatcher, route_to("d1", "d2"))
    assert ids(out) == [10, 11] and len(resp[1].seen) == 5 and migrated == [1]


async def test_a_continuation_carries_the_logit_bias_and_min_tokens(nats_url):
    """The next worker samples under the same bias and min_tokens (the engine counts the
    generated tokens toward min_tokens: tests/engine/test_logit_bias_min_tokens.py)."""

    def dies(rid):
        return [chunk(rid, 0, [10]), chunk(rid, 1, [], "error")]

    def continues(rid):
        return [chunk(rid, 1, [11], "stop")]

    sampling = SamplingSpec(temperature=0, logit_bias=[[42, 5.5]], min_tokens=3, max_tokens=8)
    async with setup(nats_url, {"d1": dies, "d2": continues}) as (dispatcher, resp, _, _):
        out = [c async for c in dispatcher.generate("r1", [1], sampling, route_to("d1", "d2"), 10)]
    second = resp[1].requests[0]
    assert ids(out) == [10, 11] and second.generated == [10]
    assert second.sampling.logit_bias == ((42, 5.5),) and second.sampling.min_tokens == 3
