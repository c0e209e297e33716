"""The bus's lean request path (libs/common/bus/client.py) on a real nats-server."""

import asyncio
import inspect
from dataclasses import dataclass
from typing import ClassVar

import pytest
from nats.aio.client import Client

from libs.common.bus.connection import Bus, BusError, Endpoint
from libs.common.messages.control import Message


@dataclass
class Num(Message):
    TYPE: ClassVar[str] = "test_num"
    n: int


def _bus(url: str) -> Bus:
    return Bus(url, name="test", connect_timeout=5.0, request_timeout=2.0)


@pytest.fixture
async def pair(nats_url):
    """A serving bus with an inline endpoint that publishes two events per request."""
    server, client = _bus(nats_url), _bus(nats_url)
    await server.connect()
    await client.connect()

    async def handle(req: Num) -> Num:
        await server.publish("t.events", Num(req.n))
        await server.publish("t.events", Num(-req.n))
        return Num(req.n + 1)

    async def slow(req: Num) -> Num:
        await asyncio.sleep(0.5)
        return Num(req.n)

    endpoints = [Endpoint("inc", "t.inc", Num, handle, inline=True),
                 Endpoint("slow", "t.slow", Num, slow, concurrent=True)]  # fmt: skip
    service = await server.add_service("tandem-test", "0.1.0", "test", endpoints)
    try:
        yield server, client, service
    finally:
        await client.close()
        await server.close()


def test_the_nats_py_internals_it_overrides_are_there():
    # Pinned nats-py 2.16: if an upgrade renames these, this fails instead of the fast
    # path silently calling methods that no longer exist.
    params = list(inspect.signature(Client._process_msg).parameters)
    assert params == ["self", "sid", "subject", "reply", "data", "headers"]
    assert list(inspect.signature(Client._flush_pending).parameters) == ["self", "force_flush"]
    for name in ("_process_headers", "_build_message", "_send_command"):
        assert callable(getattr(Client, name))


async def test_concurrent_requests_each_get_their_own_reply_from_the_read_loop(pair):
    _, client, _ = pair
    replies = await asyncio.gather(*(client.request("t.inc", Num(i), Num) for i in range(200)))
    assert [r.n for r in replies] == [i + 1 for i in range(200)]
    (sub,) = [s for s in client.nc._subs.values() if s.subject.endswith(".*")]
    assert sub._id in client.nc._inline  # replies dispatched inline...
    assert sub._wait_for_msgs_task is None  # ...so the subscription has no task of its own
    assert client._replier()._waiting == {}  # nothing left behind


async def test_an_inline_handler_s_publishes_and_reply_leave_in_one_write(pair):
    server, client, service = pair
    events: list[int] = []

    async def on_event(msg):
        events.append(Num.decode(msg.data).n)

    await client.subscribe("t.events", on_event)
    await client.nc.flush()
    writes = 0
    transport = server.nc._transport
    real = transport.writelines

    def counting(data):
        nonlocal writes
        writes += 1
        return real(data)

    transport.writelines = counting
    try:
        for i in range(1, 11):
            assert (await client.request("t.inc", Num(i), Num)).n == i + 1
    finally:
        transport.writelines = real
    assert writes == 10  # two events and the reply per request, one socket write
    for _ in range(50):
        if len(events) == 20:
            break
        await asyncio.sleep(0.02)
    assert sorted(events) == sorted([i for i in range(1, 11)] + [-i for i in range(1, 11)])
    stats = {e.name: e.num_requests for e in service.stats().endpoints}
    assert stats["inc"] == 10  # micro's own bookkeeping still sees every request


async def test_timeouts_and_absent_responders_fail_in_bounded_time(pair):
    _, client, _ = pair
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(BusError, match="no reply within"):
        await client.request("t.slow", Num(1), Num, timeout=0.1)
    with pytest.raises(BusError, match="no service is listening"):
        await client.request("t.nobody", Num(1), Num, timeout=2, responder_wait=0.1)
    assert loop.time() - start < 1.0
    assert client._replier()._waiting == {}
    assert (await client.request("t.inc", Num(1), Num)).n == 2  # and it still serves


class _BehindWriter:
    """A stream writer whose socket reports a full buffer: the bus must use the flusher."""

    def __init__(self, writer):
        self._writer = writer
        self.transport = self

    def get_write_buffer_size(self) -> int:
        return 1 << 20

    def __getattr__(self, name):
        return getattr(self._writer, name)


async def test_a_socket_that_is_behind_goes_through_nats_py_s_flusher(pair):
    _, client, _ = pair
    nc = client.nc
    real = nc._transport._io_writer
    nc._transport._io_writer = _BehindWriter(real)
    direct = 0
    write_now = nc._write_now

    def counting() -> bool:
        nonlocal direct
        wrote = write_now()
        direct += wrote
        return wrote

    nc._write_now = counting
    try:
        replies = await asyncio.gather(*(client.request("t.inc", Num(i), Num) for i in range(20)))
    finally:
        nc._transport._io_writer = real
        del nc._write_now
    assert [r.n for r in replies] == [i + 1 for i in range(20)]
    assert direct == 0  # every request went out through the flusher, and was answered
