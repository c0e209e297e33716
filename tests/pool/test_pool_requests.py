"""Bad requests get error replies and the master keeps serving; eviction under pressure."""

import asyncio
import os

import nats
import orjson
import pytest

from libs.common.bus.connection import RemoteError
from libs.common.messages.control import InfoRequest, ServiceInfo
from libs.common.messages.pool import PoolHeartbeatReply, PoolStoreRef


async def _master_still_serves(pool) -> None:
    pool.fill(0, os.urandom(4096))
    key = f"alive-{os.urandom(4).hex()}"
    assert (await pool.client.batch_put([key], pool.mem, [0], [4096]))[0].ok


def _put(*objects: dict) -> bytes:
    """A put_start body of `objects` (key "k" and a valid checksum unless they say)."""
    return orjson.dumps({"objects": [{"key": "k", "checksum": "0123456789abcdef", **o}
                                     for o in objects]})  # fmt: skip


async def test_bad_requests_get_error_replies_and_the_master_keeps_serving(pool, nats_url):
    pool.procs.store("store-a", size="4MiB")
    await pool.wait_stores(1)
    nc = await nats.connect(nats_url)
    try:
        cases = [
            ("put_start", b"{not json", "400"),
            ("put_start", _put({"size": -5}), "400"),
            ("put_start", _put({"size": 1073741824}), "413"),
            ("put_start", _put({"size": 5}, {"size": 5, "checksum": None}), "400"),
            ("put_start", b'{"objects": "many"}', "400"),
            ("unmount", b'{"store_id": "no-such-store"}', "404"),
            ("mount", b'{"store_id": "x", "segment": {"length": 5}}', "400"),
            ("mount_chunk", b'{"store_id": "x", "mount_id": "m", "index": 1}', "404"),
            ("get", b'{"keys": [1, 2]}', "400"),
            ("put_start", _put({"size": 64, "mac": "not-a-tag"}), "400"),
            ("drop", b'{"copies": [{"key": "k", "store": "s", "offset": "x", "checksum": ""}]}',
             "400"),
        ]  # fmt: skip
        for name, body, code in cases:
            msg = await nc.request(f"tandem.pool.master.{name}", body, timeout=5)
            assert (msg.headers or {}).get("Nats-Service-Error-Code") == code, (name, body)
    finally:
        await nc.close()
    await _master_still_serves(pool)


async def test_a_bad_field_gets_the_same_error_text_on_every_subject(pool, nats_url):
    # One decoder: `keys` of the wrong type reads the same whichever endpoint decodes it.
    await pool.wait_stores(0)  # the master answers
    nc = await nats.connect(nats_url)
    try:
        texts = set()
        for name in ("get", "exists", "remove"):
            msg = await nc.request(f"tandem.pool.master.{name}", b'{"keys": ["k", 7]}', timeout=5)
            assert msg.headers["Nats-Service-Error-Code"] == "400"
            texts.add(msg.headers["Nats-Service-Error"])
    finally:
        await nc.close()
    assert texts == {"pool_keys.keys[1]: Expected `str`, got `int`"}


async def test_oversized_put_raises_remote_error_413_from_the_client(pool):
    pool.procs.store("store-a", size="4MiB")
    await pool.wait_stores(1)
    with pytest.raises(RemoteError) as e:
        await pool.client.batch_put(["big"], pool.mem, [0], [5 << 20])
    assert e.value.code == 413
    await _master_still_serves(pool)


async def test_pressure_evicts_unleased_objects_only_and_keeps_the_rest_intact(pool):
    pool.procs.store("store-a", size="1MiB")
    await pool.wait_stores(1)
    size = 32 << 10  # 32 objects fill the segment
    blobs = {}

    async def put(key):
        blob = os.urandom(size)
        pool.fill(0, blob)
        result = (await pool.client.batch_put([key], pool.mem, [0], [size]))[0]
        if result.ok:
            blobs[key] = blob
        return result

    for i in range(24):
        await put(f"old-{i}")
    leased = [f"old-{i}" for i in range(8)]  # the oldest: eviction's first choice
    got = await pool.client.batch_get(leased, pool.mem, [pool.half + i * size for i in range(8)],
                                      size)  # fmt: skip
    assert all(r.ok for r in got)
    for i in range(40):  # far more than fits: evictions must happen
        assert (await put(f"new-{i}")).ok
    stats = await pool.client.stats()
    assert stats.evictions > 0
    assert await pool.client.batch_exists(leased) == len(leased)  # leased: never evicted
    present = [k for k in blobs if await pool.client.batch_exists([k]) == 1]
    assert len(blobs) - len(present) == stats.evictions  # gone only when evicted
    dst = [pool.half + i * size for i in range(len(present))]
    got = []
    for start in range(0, len(present), 8):
        got += await pool.client.batch_get(present[start:start + 8], pool.mem,
                                           dst[:len(present[start:start + 8])], size)  # fmt: skip
        for key, d in zip(present[start : start + 8], dst, strict=False):
            assert pool.read(d, size) == blobs[key], key  # what is not evicted is intact
    assert all(r.ok for r in got)


async def test_store_that_stops_heartbeating_loses_its_replicas(pool):
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    await _master_still_serves(pool)
    pool.procs.kill("store-a")  # --heartbeat-timeout 3 in the test master
    await asyncio.wait_for(pool.wait_stores(0, timeout=20), timeout=25)
    assert (await pool.client.stats()).objects == 0


async def test_heartbeat_from_an_unknown_store_asks_it_to_mount(pool):

    await pool.wait_stores(0)
    reply = await pool.bus.request("tandem.pool.master.heartbeat", PoolStoreRef("ghost", 1),
                                   PoolHeartbeatReply)  # fmt: skip
    assert reply.known is False


async def test_master_endpoints_show_in_micro_info_and_stats(pool, nats_url):
    # `nats micro info` and `nats micro stats` list every endpoint of the master and
    # count its requests.
    pool.procs.store("store-a", size="4MiB")
    await pool.wait_stores(1)
    for _ in range(5):
        assert await pool.client.batch_exists(["0" * 32]) == 0
    nc = await nats.connect(nats_url)
    try:
        info = orjson.loads(
            (await nc.request("$SRV.INFO.tandem-cache_master", b"", timeout=5)).data
        )
        names = {e["name"] for e in info["endpoints"]}
        assert {"put_start", "put_end", "get", "exists", "remove", "stats"} <= names
        stats = orjson.loads(
            (await nc.request("$SRV.STATS.tandem-cache_master", b"", timeout=5)).data
        )
        counts = {e["name"]: e["num_requests"] for e in stats["endpoints"]}
        assert counts["exists"] >= 5
    finally:
        await nc.close()


async def test_store_info_shows_its_transfer_engine_and_advertised_host(pool):
    pool.procs.store("store-i", "--transfer-advertise-host", "127.0.0.9",
                     "--transfer-stall-timeout", "4")  # fmt: skip
    await pool.wait_stores(1)
    info = await pool.bus.request("tandem.cache_store.store-i.info", InfoRequest(), ServiceInfo)
    transfer = info.details["transfer"]
    assert transfer["transport"] == "tcp" and transfer["state"] == "running"
    assert transfer["stall_timeout_s"] == 4.0
    assert transfer["endpoint"].startswith("127.0.0.9:")  # what peers dial
    assert info.details["transfer_endpoint"] == transfer["endpoint"]
