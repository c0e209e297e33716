"""A nats-server restarted on the same port without its state: the bus reconnects by itself,
its reconnect hooks run, and the KV events stream they keep exists again."""

import asyncio

import nats
import pytest

from libs.common.bus.connection import Bus
from libs.common.bus.kv_events import STREAM_NAME, keep_kv_stream
from scripts.nats_server import NatsServer


@pytest.fixture
def restartable(tmp_path):
    servers = [NatsServer(tmp_path / "nats-1").start()]
    yield servers
    for server in servers:
        server.stop()


async def test_kv_stream_is_recreated_after_a_stateless_nats_restart(restartable, tmp_path):
    first = restartable[0]
    bus = Bus(first.url, "reconnect-test", connect_timeout=5, request_timeout=2)
    await bus.connect()
    hooked = asyncio.Event()

    async def hook() -> None:
        hooked.set()

    try:
        bus.on_reconnect(hook)
        await keep_kv_stream(bus, "tandem")
        first.kill()
        second = NatsServer(tmp_path / "nats-2", port=first.port).start()  # empty store
        restartable.append(second)
        await asyncio.wait_for(hooked.wait(), 10)
        nc = await nats.connect(second.url)
        try:
            js = nc.jetstream()
            async with asyncio.timeout(10):
                while True:
                    try:
                        await js.stream_info(STREAM_NAME)
                        break
                    except nats.js.errors.NotFoundError:
                        await asyncio.sleep(0.1)
        finally:
            await nc.close()
        assert bus.connected
    finally:
        await bus.close()
