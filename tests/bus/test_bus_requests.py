"""The bus's request/reply path on stock nats-py (libs/common/bus/connection.py), on a real
nats-server."""

import asyncio

import pytest
from nats.aio.client import Client

from libs.common.bus.connection import Bus, BusError, Endpoint
from libs.common.messages.control import Message


class Num(Message, tag="test_num"):
    n: int


def _bus(url: str) -> Bus:
    return Bus(url, name="test", connect_timeout=5.0, request_timeout=2.0)


@pytest.fixture
async def pair(nats_url):
    """A serving bus whose `inc` endpoint publishes two events per request."""
    server, client = _bus(nats_url), _bus(nats_url)
    await server.connect()
    await client.connect()

    async def handle(req: Num) -> Num:
        await server.publish("t.events", Num(req.n))
        await server.publish("t.events", Num(-req.n))
        return Num(req.n + 1)

    async def slow(req: Num) -> Num:
        await asyncio.sleep(0.3)
        return Num(req.n)

    endpoints = [Endpoint("inc", "t.inc", Num, handle),
                 Endpoint("slow", "t.slow", Num, slow, concurrent=True)]  # fmt: skip
    service = await server.add_service("tandem-test", "0.1.0", "test", endpoints)
    try:
        yield server, client, service
    finally:
        await client.close()
        await server.close()


async def test_the_bus_connection_is_a_stock_nats_py_client(pair):
    server, client, _ = pair
    assert type(server.nc) is Client and type(client.nc) is Client  # no subclass, no override


async def test_concurrent_requests_each_get_their_own_reply(pair):
    _, client, _ = pair
    replies = await asyncio.gather(*(client.request("t.inc", Num(i), Num) for i in range(200)))
    assert [r.n for r in replies] == [i + 1 for i in range(200)]


async def test_a_handler_s_publishes_arrive_and_micro_counts_every_request(pair):
    _, client, service = pair
    events: list[int] = []

    async def on_event(msg):
        events.append(Num.decode(msg.data).n)

    await client.subscribe("t.events", on_event)  # Bus.subscribe settles by itself
    for i in range(1, 11):
        assert (await client.request("t.inc", Num(i), Num)).n == i + 1
    for _ in range(50):
        if len(events) == 20:
            break
        await asyncio.sleep(0.02)
    assert sorted(events) == sorted([i for i in range(1, 11)] + [-i for i in range(1, 11)])
    stats = {e.name: e.num_requests for e in service.stats().endpoints}
    assert stats["inc"] == 10


async def test_timeouts_and_absent_responders_fail_in_bounded_time(pair):
    _, client, _ = pair
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(BusError, match="no reply within"):
        await client.request("t.slow", Num(1), Num, timeout=0.1)
    with pytest.raises(BusError, match="no service is listening"):
        await client.request("t.nobody", Num(1), Num, timeout=2, responder_wait=0.1)
    assert loop.time() - start < 1.0
    assert (await client.request("t.inc", Num(1), Num)).n == 2  # and it still serves


async def test_stopped_services_stop_answering_and_stop_is_safe_twice(pair):
    server, client, _ = pair
    await server.stop_services()
    await server.stop_services()
    with pytest.raises(BusError, match="no service is listening"):
        await client.request("t.inc", Num(1), Num, timeout=2, responder_wait=0.1)
