"""The rdma queue-pair exchange wired over a real nats-server, as the services wire it.

The verbs are fake (tests/transfer/fake_verbs.py: no RDMA device here); the bus, the
micro endpoint, the messages and the engines' token check are real.
"""

from __future__ import annotations

import os

import pytest

from libs.common.bus.connection import Bus, RemoteError
from libs.common.messages.control import RdmaConnect
from libs.common.transfer import TransferError, create_engine
from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.rdma import engine as rdma
from libs.common.transfer.rdma.exchange import connect_subject, engine_options, serve_connect
from tests.transfer.fake_verbs import make_verbs


@pytest.fixture
async def pair(nats_server, monkeypatch: pytest.MonkeyPatch):
    verbs = make_verbs()
    monkeypatch.setattr(rdma, "load_pyverbs", lambda: verbs)
    monkeypatch.setattr(rdma, "rdma_devices", lambda: ["fake0"])
    buses, engines = [], []
    try:
        for sid in ("prefill-a", "decode-b"):
            bus = Bus(nats_server.url, sid, 5, 5)
            await bus.connect()
            buses.append(bus)
            engine = create_engine("rdma", **engine_options("rdma", bus, "tandem", sid))
            await engine.start()
            engines.append(engine)
            await serve_connect(bus, engine, "tandem", sid)
        yield buses, engines
    finally:
        for engine in engines:
            await engine.stop()
        for bus in buses:
            await bus.close()


async def test_engines_connect_over_nats_and_move_bytes(pair) -> None:
    _, (a, b) = pair
    assert (a.endpoint, b.endpoint) == ("prefill-a", "decode-b")
    src, dst = a.allocate(1 << 20), b.allocate(1 << 20)
    src[:] = payload = os.urandom(1 << 20)
    d_src, d_dst = a.register(src), b.register(dst)
    await a.write(d_src, d_dst, [(0, 0, 1 << 20)])
    assert dst == payload
    src[:] = bytes(1 << 20)
    await a.read(d_src, d_dst, [(4096, 4096, 8192)])
    assert src[4096:12288] == payload[4096:12288] and src[:4096] == bytes(4096)


async def test_a_forged_token_or_garbage_exchange_is_refused_and_the_peer_keeps_serving(
    pair,
) -> None:
    (bus_a, _), (a, b) = pair
    d_src, d_dst = a.register(a.allocate(4096)), b.register(b.allocate(4096))
    forged = RegionDescriptor.from_dict({**d_dst.to_dict(), "token": "11" * 16})
    with pytest.raises(TransferError, match="token"):
        await a.write(d_src, forged, [(0, 0, 4096)])
    with pytest.raises(RemoteError) as info:
        await bus_a.request(connect_subject("tandem", "decode-b"), RdmaConnect({"qps": "x"}),
                            RdmaConnect)  # fmt: skip
    assert info.value.code == 400
    raw = await bus_a.nc.request(connect_subject("tandem", "decode-b"), b"\xff{", timeout=5)
    assert raw.headers["Nats-Service-Error-Code"] == "400"
    await a.write(d_src, d_dst, [(0, 0, 4096)])  # the genuine descriptor still works


async def test_tcp_and_shm_need_no_exchange(nats_server) -> None:
    bus = Bus(nats_server.url, "t", 5, 5)
    assert engine_options("tcp", bus, "tandem", "x") == {}
    engine = create_engine("shm")
    await engine.start()
    try:
        await serve_connect(bus, engine, "tandem", "x")  # not connected: must not touch NATS
    finally:
        await engine.stop()
