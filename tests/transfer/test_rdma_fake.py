"""The rdma engine's logic on fake verbs: exchange, token gate, slicing, completions."""

from __future__ import annotations

import asyncio
import os

import pytest

from libs.common.transfer import TransferError
from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.rdma import engine as rdma
from libs.common.transfer.rdma.engine import RdmaTransferEngine
from tests.transfer.fake_verbs import make_verbs


@pytest.fixture
async def rdma_pair(monkeypatch: pytest.MonkeyPatch):
    verbs = make_verbs()
    monkeypatch.setattr(rdma, "load_pyverbs", lambda: verbs)
    monkeypatch.setattr(rdma, "rdma_devices", lambda: ["fake0"])
    engines: dict[str, RdmaTransferEngine] = {}
    exchanges: list[str] = []

    async def connect_peer(endpoint: str, request: dict) -> dict:
        exchanges.append(endpoint)  # in a service: a NATS request
        return await engines[endpoint].accept_peer(request)

    a = RdmaTransferEngine(connect_peer=connect_peer, slice_bytes=64 << 10, batch_timeout_s=10)
    b = RdmaTransferEngine(connect_peer=connect_peer, engine_id="decode-0")
    await a.start()
    await b.start()
    engines[a.endpoint], engines[b.endpoint] = a, b
    try:
        yield a, b, exchanges
    finally:
        await a.stop()
        await b.stop()


async def test_write_read_over_fake_verbs_with_one_exchange(rdma_pair) -> None:
    a, b, exchanges = rdma_pair
    src, dst = a.allocate(1 << 20), b.allocate(1 << 20)
    payload = os.urandom(1 << 20)
    src[:] = payload
    d_src, d_dst = a.register(src), b.register(dst)
    assert d_dst.endpoint == "decode-0" and d_dst.rkey != 0
    await a.write(d_src, d_dst, [(0, 0, 300_000), (300_000, 300_000, (1 << 20) - 300_000)])
    assert dst == payload
    src[:] = bytes(1 << 20)
    await asyncio.gather(*(a.read(d_src, d_dst, [(i << 16, i << 16, 1 << 16)]) for i in range(16)))
    assert src == payload
    assert exchanges == ["decode-0"]  # QPs are set up once per peer
    assert a.info()["transport"] == "rdma"


async def test_peer_without_a_valid_token_is_not_connected(rdma_pair) -> None:
    a, b, _ = rdma_pair
    d_src, d_dst = a.register(a.allocate(4096)), b.register(b.allocate(4096))
    forged = RegionDescriptor.from_dict({**d_dst.to_dict(), "token": "11" * 16})
    with pytest.raises(TransferError, match="token") as info:
        await a.write(d_src, forged, [(0, 0, 16)])
    assert info.value.peer == "decode-0"


async def test_bad_rkey_fails_the_batch_naming_the_op_then_link_recovers(rdma_pair) -> None:
    a, b, exchanges = rdma_pair
    dst = b.allocate(4096)
    d_src, d_dst = a.register(a.allocate(4096)), b.register(dst)
    forged = RegionDescriptor.from_dict({**d_dst.to_dict(), "rkey": d_dst.rkey + 999})
    with pytest.raises(TransferError, match="completion status") as info:
        await a.write(d_src, forged, [(0, 0, 0), (0, 0, 16)])
    assert info.value.op_index == 1 and info.value.op == (0, 0, 16)
    assert dst == bytes(4096)
    await a.write(d_src, d_dst, [(0, 0, 16)])  # the link reconnects after the error
    assert exchanges == ["decode-0", "decode-0"]


async def test_rdma_needs_the_exchange_callable() -> None:
    with pytest.raises(ValueError, match="connect_peer"):
        RdmaTransferEngine()


async def test_a_peer_that_stops_completing_fails_the_batch_within_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One send-queue slot and two slices: the second waits for room that never comes.
    verbs = make_verbs()
    monkeypatch.setattr(rdma, "load_pyverbs", lambda: verbs)
    monkeypatch.setattr(rdma, "rdma_devices", lambda: ["fake0"])
    engines: dict[str, RdmaTransferEngine] = {}

    async def connect_peer(endpoint: str, request: dict) -> dict:
        return await engines[endpoint].accept_peer(request)

    a = RdmaTransferEngine(connect_peer=connect_peer, slice_bytes=64 << 10, max_send_wr=1,
                           batch_timeout_s=0.3)  # fmt: skip
    b = RdmaTransferEngine(connect_peer=connect_peer, engine_id="decode-0")
    async with a, b:
        engines[a.endpoint], engines[b.endpoint] = a, b
        d_src, d_dst = a.register(a.allocate(1 << 20)), b.register(b.allocate(1 << 20))
        await a.write(d_src, d_dst, [(0, 0, 128 << 10)])  # connected, completions flow
        monkeypatch.setattr(verbs.QP, "post_send", lambda self, wr: None)  # they stop
        with pytest.raises(TransferError, match="timed out") as info:
            await asyncio.wait_for(a.write(d_src, d_dst, [(0, 0, 128 << 10)]), 5)
        assert info.value.peer == "decode-0"
        assert a._tracker.outstanding == 0  # nothing left for the poller to wait on
