"""Soft pins on a real pool (issue 26): nats-server with JetStream, master and store
processes, an in-process client. Pinned objects stay through an eviction pressure that
evicts the unpinned ones, a pin past the bound is refused, a TTL ends a pin, and a new
leader keeps the pins of a killed one."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from libs.common.bus.connection import BusError, RemoteError
from libs.common.messages.pins import PoolPin, PoolPinInfo, PoolPinList, PoolPinRef
from tests.pool.conftest import master_and_client

SIZE = 64 << 10  # 16 objects in a 1 MiB segment; the default bound (0.25) holds 4
SYS = ["sys-0", "sys-1", "sys-2"]  # a system prompt's pages


async def put(pool, keys: list[str], slot: int = 0) -> None:
    """Put `keys` (random bytes) from buffer slots `slot`...; one put per key."""
    for i, key in enumerate(keys):
        offset = (slot + i) % 64 * SIZE
        pool.fill(offset, os.urandom(SIZE))
        (result,) = await pool.client.batch_put([key], pool.mem, [offset], [SIZE])
        assert result.ok or result.error == "exists", (key, result.error)


async def pressure(pool, count: int = 48) -> None:
    """Other traffic: three segments' worth of objects."""
    await put(pool, [f"other-{i}" for i in range(count)], slot=len(SYS))


async def read_back(pool, keys: list[str]) -> list[str]:
    """Keys whose bytes read back unequal to what was put (or missed)."""
    dst = [pool.half + i * SIZE for i in range(len(keys))]
    got = await pool.client.batch_get(keys, pool.mem, dst, SIZE)
    return [k for i, (k, r) in enumerate(zip(keys, got, strict=True))
            if not r.ok or pool.read(dst[i], SIZE) != pool.read(i * SIZE, SIZE)]  # fmt: skip


async def pin(pool, keys: list[str], ttl: float = 300.0) -> PoolPinInfo:
    return await pool.bus.request("tandem.pool.master.pin", PoolPin(keys, ttl, "system prompt"),
                                  PoolPinInfo)  # fmt: skip


async def pins(pool, **kw) -> PoolPinList:
    return await pool.bus.request("tandem.pool.master.pins", PoolPinList(), PoolPinList, **kw)


@pytest.fixture
async def pool(pool_procs, nats_url):
    async with master_and_client(pool_procs, nats_url) as harness:
        harness.procs.store("store-a", size="1MiB")
        await harness.wait_stores(1)
        yield harness


async def test_pinned_pages_stay_through_pressure_that_evicts_unpinned_ones(pool):
    await put(pool, SYS)
    await put(pool, ["early"], slot=60)  # unpinned, put after the pinned ones
    info = await pin(pool, SYS)
    assert (info.pages, info.present, info.held, info.bytes) == (3, 3, 3, 3 * SIZE)
    await pressure(pool)
    stats = await pool.client.stats()
    assert stats.evictions >= 32, stats
    assert await pool.client.batch_exists(["early"]) == 0  # the LRU took the younger one
    assert await read_back(pool, SYS) == []  # and kept the older pinned ones, byte-equal
    listed = await pins(pool)
    assert [p.pin_id for p in listed.pins] == [info.pin_id]
    assert listed.held_bytes == 3 * SIZE <= listed.budget_bytes == (1 << 20) // 4


async def test_pages_put_after_their_pin_are_held_from_their_put(pool):
    await put(pool, ["seed"], slot=60)  # the pool's object size prices absent pages
    info = await pin(pool, SYS)
    assert info.present == 0
    await put(pool, SYS)
    await pressure(pool)
    assert await read_back(pool, SYS) == []


async def test_a_pin_past_the_bound_is_refused_with_409_and_evicted_as_usual(pool):
    keys = [f"big-{i}" for i in range(5)]  # 5 x 64 KiB > a quarter of 1 MiB
    await put(pool, keys)
    with pytest.raises(RemoteError) as refused:
        await pin(pool, keys)
    assert refused.value.code == 409 and "--max-pinned-fraction" in refused.value.message
    assert (await pins(pool)).pins == []
    await pressure(pool)
    assert await pool.client.batch_exists(keys[:1]) == 0


async def test_a_pin_ends_at_its_ttl_and_unpin_ends_one_at_once(pool):
    await put(pool, SYS)
    short = await pin(pool, SYS[:1], ttl=1.0)
    other = await pin(pool, SYS[1:])
    gone = await pool.bus.request("tandem.pool.master.unpin", PoolPinRef(other.pin_id),
                                  PoolPinInfo)  # fmt: skip
    assert gone.pin_id == other.pin_id
    with pytest.raises(RemoteError) as unknown:
        await pool.bus.request("tandem.pool.master.unpin", PoolPinRef(other.pin_id), PoolPinInfo)
    assert unknown.value.code == 404
    deadline = time.monotonic() + 5
    while [p.pin_id for p in (await pins(pool)).pins] == [short.pin_id]:
        assert time.monotonic() < deadline, "the 1 s pin did not expire within 5 s"
        await asyncio.sleep(0.1)
    assert (await pins(pool)).held_bytes == 0
    await pressure(pool)
    assert await pool.client.batch_exists(SYS[:1]) == 0


async def test_a_new_leader_keeps_the_pins_of_a_killed_one(pool_procs, nats_url):
    async with master_and_client(pool_procs, nats_url) as pool:  # `master` leads
        pool.procs.start("cache_master", "master-b", "--heartbeat-timeout", "3")
        pool.procs.store("store-a", size="1MiB")
        await pool.wait_stores(1)
        await put(pool, SYS)
        info = await pin(pool, SYS)
        await asyncio.sleep(0.6)  # the store's index has the puts
        pool.procs.kill("master")  # kill -9 of the leader
        deadline = time.monotonic() + 20
        while True:  # the standby leads, has read the pins and the store has mounted
            try:
                listed = await pins(pool, timeout=0.5, responder_wait=0.05)
                if listed.held_bytes == 3 * SIZE:
                    break
            except BusError:
                pass
            assert time.monotonic() < deadline, "no leader with the pin within 20 s"
            await asyncio.sleep(0.1)
        assert [(p.pin_id, p.pages, p.label) for p in listed.pins] == [
            (info.pin_id, 3, "system prompt")
        ]
        await pressure(pool)
        assert await read_back(pool, SYS) == []
