"""The bus on a real nats-server: bounded first connect, typed RPC, errors as replies."""

import asyncio
import time

import pytest

from libs.common.bus.connection import Bus, BusError, Endpoint, HandlerError, RemoteError, discover
from libs.common.messages.control import Message
from scripts.nats_server import NatsServer


class Ping(Message, tag="test_ping"):
    n: int


class Pong(Message, tag="test_pong"):
    n: int


def _bus(url: str, connect_timeout: float = 5.0) -> Bus:
    return Bus(url, name="test", connect_timeout=connect_timeout, request_timeout=2.0)


async def _serve(bus: Bus) -> None:
    async def handle(req: Ping) -> Pong:
        if req.n < 0:
            raise HandlerError(400, "n must be >= 0")
        if req.n == 13:
            raise RuntimeError("unlucky")
        if req.n == 99:
            await asyncio.sleep(0.5)
        return Pong(n=req.n + 1)

    ep = Endpoint("ping", "t.ping", Ping, handle, concurrent=True)
    await bus.add_service("tandem-test", "0.1.0", "test service", [ep])


async def test_connect_to_absent_server_fails_in_bounded_time_naming_url():
    bus = _bus("nats://127.0.0.1:1", connect_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(BusError, match=r"nats://127\.0\.0\.1:1"):
        await bus.connect()
    assert time.monotonic() - t0 < 5
    await bus.close()
    await bus.close()  # twice is fine


async def test_typed_request_reply_through_micro_endpoint(nats_url):
    server, client = _bus(nats_url), _bus(nats_url)
    await server.connect()
    await client.connect()
    try:
        await _serve(server)
        assert (await client.request("t.ping", Ping(n=1), Pong)).n == 2
    finally:
        await client.close()
        await server.close()


async def test_handler_errors_become_error_replies_and_service_keeps_serving(nats_url):
    server, client = _bus(nats_url), _bus(nats_url)
    await server.connect()
    await client.connect()
    try:
        await _serve(server)
        with pytest.raises(RemoteError) as bad:
            await client.request("t.ping", Ping(n=-1), Pong)
        assert bad.value.code == 400 and "n must be" in bad.value.message
        with pytest.raises(RemoteError) as boom:
            await client.request("t.ping", Ping(n=13), Pong)
        assert boom.value.code == 500 and "unlucky" in boom.value.message
        raw = await client.nc.request("t.ping", b"{not json", timeout=2)
        assert raw.headers["Nats-Service-Error-Code"] == "400"
        assert (await client.request("t.ping", Ping(n=5), Pong)).n == 6
    finally:
        await client.close()
        await server.close()


async def test_concurrent_endpoint_serves_requests_in_parallel(nats_url):
    server, client = _bus(nats_url), _bus(nats_url)
    await server.connect()
    await client.connect()
    try:
        await _serve(server)
        t0 = time.monotonic()
        replies = await asyncio.gather(
            *(client.request("t.ping", Ping(n=99), Pong) for _ in range(4))
        )
        assert [r.n for r in replies] == [100] * 4
        assert time.monotonic() - t0 < 1.5  # 4 x 0.5 s would be 2 s serially
    finally:
        await client.close()
        await server.close()


async def test_request_without_responder_or_reply_fails_with_subject(nats_url):
    client = _bus(nats_url)
    await client.connect()
    try:
        with pytest.raises(BusError, match=r"t\.nobody"):
            await client.request("t.nobody", Ping(n=1), Pong, timeout=0.5)
    finally:
        await client.close()


async def test_micro_discovery_lists_service_with_endpoints(nats_url):
    server = _bus(nats_url)
    await server.connect()
    try:
        await _serve(server)
        replies = await discover(server.nc, "tandem-test")
        assert [r["name"] for r in replies] == ["tandem-test"]
        info = await server.nc.request("$SRV.INFO.tandem-test", b"", timeout=2)
        assert b'"t.ping"' in info.data
    finally:
        await server.close()


async def test_bus_reconnects_after_nats_restart(tmp_path):
    first = NatsServer(tmp_path / "n").start()
    port = first.port
    server, client = _bus(first.url), _bus(first.url)
    await server.connect()
    await client.connect()
    await _serve(server)
    try:
        first.stop()
        second = NatsServer(tmp_path / "n", port=port).start()
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert (await client.request("t.ping", Ping(n=7), Pong, timeout=0.5)).n == 8
                    break
                except BusError:
                    assert time.monotonic() < deadline, "no reconnect within 10 s"
                    await asyncio.sleep(0.1)
            assert server.connected and client.connected
        finally:
            await client.close()
            await server.close()
            second.stop()
    finally:
        first.stop()
