"""Stored responses (services/router/requests/stored.py) on a real nats-server with
JetStream: the bucket takes the router's TTL and size flags, a response survives the
store object that wrote it, one larger than a NATS message is not stored, and a bad value
in the bucket reads as no response; JetStream down is a 503 on reads, no store on writes."""

from __future__ import annotations

import pytest

from libs.common.bus.connection import Bus
from libs.common.bus.permissions import responses_bucket
from libs.common.messages.responses import StoredResponse
from services.router.config import RouterConfig
from services.router.errors import ApiError
from services.router.requests.stored import ResponseStore

ID = "resp_" + "b" * 32


async def connected(url: str) -> Bus:
    bus = Bus(url, "router-test", 5, 5)
    await bus.connect()
    return bus


async def test_the_bucket_has_the_flags_bounds_and_outlives_its_writer(nats_url):
    config = RouterConfig(nats_url=nats_url, responses_ttl=120.0, responses_max_mb=8)
    bus = await connected(nats_url)
    try:
        record = StoredResponse(ID, 1.0, [{"role": "user", "content": "hi"}], {"id": ID})
        assert await ResponseStore(bus, config).put(record)
        info = await bus.nc.jetstream().stream_info(f"KV_{responses_bucket('tandem')}")
        assert info.config.max_age == 120.0 and info.config.max_bytes == 8 << 20
        assert await ResponseStore(bus, config).get(ID) == record  # another router's store
    finally:
        await bus.close()


async def test_a_response_larger_than_a_message_is_not_stored(nats_url):
    bus = await connected(nats_url)
    try:
        store = ResponseStore(bus, RouterConfig(nats_url=nats_url))
        big = "x" * (bus.nc.max_payload + 1)
        assert not await store.put(StoredResponse(ID, 1.0, [{"role": "user", "content": big}]))
        assert await store.get(ID) is None
    finally:
        await bus.close()


async def test_an_unreadable_value_is_no_response(nats_url):
    bus = await connected(nats_url)
    try:
        store = ResponseStore(bus, RouterConfig(nats_url=nats_url))
        assert await store.put(StoredResponse(ID, 1.0))
        kv = await bus.nc.jetstream().key_value(responses_bucket("tandem"))
        await kv.put(ID, b'{"type": "stored_response", "v": 1}')  # no id: not a record
        assert await store.get(ID) is None
        assert not await store.delete("resp_" + "c" * 32)
    finally:
        await bus.close()


async def test_jetstream_down_is_a_503_on_reads_and_no_store_on_writes(nats_server):
    bus = await connected(nats_server.url)
    try:
        store = ResponseStore(bus, RouterConfig(nats_url=nats_server.url, request_timeout=1.0))
        assert await store.put(StoredResponse(ID, 1.0))
        nats_server.stop()
        assert not await store.put(StoredResponse(ID, 2.0))
        with pytest.raises(ApiError) as e:
            await store.get(ID)
        assert e.value.status == 503 and e.value.code == "store_unavailable"
    finally:
        await bus.close()
