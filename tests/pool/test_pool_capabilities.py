"""Capabilities of pool clients, on a real master and store over real sockets: a get's
descriptor reads that get's objects only, a put's writes its allocated ranges only and
only until put_end or put_revoke (docs/pool.md, "Capabilities")."""

from __future__ import annotations

import asyncio
import os

import pytest

from libs.common.messages.pool import (
    PoolCount,
    PoolGetReply,
    PoolKeys,
    PoolNewObject,
    PoolPutFinish,
    PoolPutStart,
    PoolPutStartReply,
)
from libs.common.transfer import RegionDescriptor, TransferError
from tests.pool.conftest import master_and_client

SIZE = 64 << 10


async def _put(h, keys):
    blobs = [os.urandom(SIZE) for _ in keys]
    for i, blob in enumerate(blobs):
        h.fill(i * SIZE, blob)
    res = await h.client.batch_put(keys, h.mem, [i * SIZE for i in range(len(keys))],
                                   [SIZE] * len(keys))  # fmt: skip
    assert all(r.ok for r in res), res


async def _where(h, key):
    reply = await h.bus.request("tandem.pool.master.get", PoolKeys([key]), PoolGetReply)
    ((store, offset),) = [(r.store, r.offset) for r in reply.objects[0].replicas]
    return offset, RegionDescriptor.from_dict(reply.segments[store])


async def _put_start(h, key):
    new = PoolNewObject(key, SIZE, "0" * 16)
    reply = await h.bus.request("tandem.pool.master.put_start", PoolPutStart([new]),
                                PoolPutStartReply)  # fmt: skip
    (replica,) = reply.slots[0].replicas
    return reply.put_id, replica.offset, RegionDescriptor.from_dict(reply.segments[replica.store])


@pytest.fixture
async def pool(pool_procs, nats_url):
    async with master_and_client(pool_procs, nats_url, "--lease-ttl", "1") as h:
        pool_procs.store("store-a")
        await h.wait_stores(1)
        yield h


async def test_a_gets_grant_reads_its_object_and_nothing_else(pool):
    await _put(pool, ["cap-a", "cap-b"])
    a_offset, a_grant = await _where(pool, "cap-a")
    b_offset, b_grant = await _where(pool, "cap-b")
    assert a_grant.region_id != b_grant.region_id
    dst = pool.mem.region
    await pool.engine.read(dst, a_grant, [(pool.half, a_offset, SIZE)])
    with pytest.raises(TransferError, match="outside the granted ranges"):
        await pool.engine.read(dst, a_grant, [(pool.half, b_offset, SIZE)])
    with pytest.raises(TransferError, match="outside the granted ranges"):
        await pool.engine.read(dst, a_grant, [(pool.half, a_offset, SIZE + 1)])
    with pytest.raises(TransferError, match="grant is read-only"):
        await pool.engine.write(dst, a_grant, [(0, a_offset, 16)])


async def test_a_gets_grant_ends_with_its_lease(pool):
    await _put(pool, ["cap-lease"])
    offset, grant = await _where(pool, "cap-lease")
    await asyncio.sleep(1.2)  # --lease-ttl 1
    with pytest.raises(TransferError, match=r"grant expired|unknown region"):
        await pool.engine.read(pool.mem.region, grant, [(pool.half, offset, SIZE)])


async def test_a_puts_grant_writes_its_ranges_until_put_end_and_no_longer(pool):
    put_id, offset, grant = await _put_start(pool, "cap-put")
    src = pool.mem.region
    await pool.engine.write(src, grant, [(0, offset, SIZE)])
    for op in ((0, offset + SIZE, 16), (0, offset + SIZE - 16, 32)):  # past it, straddling
        with pytest.raises(TransferError, match="outside the granted ranges"):
            await pool.engine.write(src, grant, [op])
    await pool.bus.request("tandem.pool.master.put_end", PoolPutFinish(put_id, ["cap-put"]),
                           PoolKeys)  # fmt: skip
    with pytest.raises(TransferError, match="unknown region or wrong token"):
        await pool.engine.write(src, grant, [(0, offset, 16)])


async def test_a_revoked_puts_grant_writes_nothing(pool):
    put_id, offset, grant = await _put_start(pool, "cap-revoke")
    await pool.bus.request("tandem.pool.master.put_revoke",
                           PoolPutFinish(put_id, ["cap-revoke"]), PoolCount)  # fmt: skip
    with pytest.raises(TransferError, match="unknown region or wrong token"):
        await pool.engine.write(pool.mem.region, grant, [(0, offset, 16)])
