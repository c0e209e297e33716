"""A new subscription is on the server when Bus.subscribe returns, even when the SUB is
slow on its way: a message another connection publishes right after reaches it.

nats-py's flush() writes its PING ahead of a SUB still queued for its flusher task, so one
PONG can come back before the server has read the SUB (libs/common/bus/connection.py,
`settle`). A proxy between the subscriber and a real nats-server holds each SUB for a
moment, keeping the byte order: the race that a loaded host runs into about once in 20
fresh subscriptions happens every time here."""

from __future__ import annotations

import asyncio
import contextlib

import nats

from libs.common.bus.connection import Bus

HOLD_S = 0.2  # how long the proxy holds a SUB (everything behind it waits too)


class SlowSubProxy:
    """Loopback TCP proxy to a NATS server that delays, in order, the client's bytes from
    each line starting with `SUB `."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server: asyncio.Server | None = None
        self.port = 0
        self.held = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        for pump in (self._to_server(reader, up_writer), self._copy(up_reader, writer)):
            task = asyncio.create_task(pump)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _to_server(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                at = 0 if data.startswith(b"SUB ") else data.find(b"\r\nSUB ")
                if at >= 0:
                    at += 0 if at == 0 else 2  # the SUB line's first byte
                    writer.write(data[:at])
                    await writer.drain()
                    self.held += 1
                    await asyncio.sleep(HOLD_S)
                    data = data[at:]
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _published_once_arrives(subscribe, publisher, subject: str, wait_s: float) -> bool:
    got = asyncio.Event()

    async def on_msg(msg) -> None:
        got.set()

    await subscribe(subject, on_msg)
    await publisher.publish(subject, b"one")  # another connection, straight to the server
    await publisher.flush()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(got.wait(), wait_s)
    return got.is_set()


async def test_bus_subscribe_returns_with_the_subscription_on_the_server(nats_server):
    port = int(nats_server.url.rsplit(":", 1)[1])
    proxy = SlowSubProxy(port)
    await proxy.start()
    publisher = await nats.connect(nats_server.url)
    bus = Bus(
        f"nats://127.0.0.1:{proxy.port}",
        name="settle-test",
        connect_timeout=5.0,
        request_timeout=2.0,
    )
    plain = await nats.connect(f"nats://127.0.0.1:{proxy.port}")
    try:
        await bus.connect()

        async def plain_subscribe(subject, cb) -> None:  # subscribe + one flush
            await plain.subscribe(subject, cb=cb)
            await plain.flush()

        # The race, as the proxy makes it: one flush returns before the server has the SUB,
        # and the message is not delivered (nats-py 2.16; if this starts arriving, nats-py
        # orders its PING behind queued commands and settle's second flush can go).
        assert not await _published_once_arrives(plain_subscribe, publisher, "t.plain", 1.0)
        held = proxy.held
        for n in range(3):  # every fresh subscription, not a lucky one
            assert await _published_once_arrives(bus.subscribe, publisher, f"t.bus.{n}", 5.0)
        assert proxy.held >= held + 3  # each SUB did go through the delay
    finally:
        await bus.close()
        await plain.close()
        await publisher.close()
        await proxy.stop()
