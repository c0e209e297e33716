"""The pool under failures: dead stores, a restarted master, corrupt bytes, short leases."""

import os

import pytest

from libs.common.messages.pool import PoolGetReply, PoolKeys
from tests.pool.conftest import corrupt_segment_file


async def _put_blobs(pool, keys, size, replicas=0):
    blobs = [os.urandom(size) for _ in keys]
    for i, blob in enumerate(blobs):
        pool.fill(i * size, blob)
    put = await pool.client.batch_put(keys, pool.mem, [i * size for i in range(len(keys))],
                                      [size] * len(keys), replicas=replicas)  # fmt: skip
    assert all(r.ok for r in put), put
    return blobs


async def _get_all(pool, keys, size):
    dst = [pool.half + i * size for i in range(len(keys))]
    got = await pool.client.batch_get(keys, pool.mem, dst, size)
    return got, [pool.read(d, size) for d in dst]


async def test_get_serves_from_the_other_replica_after_kill_9_of_a_store(pool):
    pool.procs.store("store-a")
    pool.procs.store("store-b")
    await pool.wait_stores(2)
    keys = [f"fo-{i}" for i in range(16)]
    blobs = await _put_blobs(pool, keys, 8192, replicas=2)
    pool.procs.kill("store-a")
    got, data = await _get_all(pool, keys, 8192)  # the master still lists store-a
    assert all(r.ok for r in got) and data == blobs


@pytest.mark.slow
async def test_every_object_is_readable_after_master_kill_9_and_restart(pool):
    pool.procs.store("store-a")
    pool.procs.store("store-b")
    await pool.wait_stores(2)
    keys = [f"mr-{i}" for i in range(40)]
    blobs = await _put_blobs(pool, keys, 4096)
    pool.procs.kill("master")
    pool.procs.master()
    await pool.wait_stores(2)
    await pool.wait_objects(len(keys))
    assert await pool.client.batch_exists(keys) == len(keys)
    got, data = await _get_all(pool, keys, 4096)
    assert all(r.ok for r in got) and data == blobs
    # And the restarted master places new objects without overlapping the old ones.
    more = [f"mr2-{i}" for i in range(40)]
    await _put_blobs(pool, more, 4096)
    got, data = await _get_all(pool, keys, 4096)
    assert data == blobs


async def test_corrupted_bytes_are_reported_as_a_miss_and_the_object_dropped(pool, tmp_path):
    pool.procs.store("store-a", "--segment-file", str(tmp_path / "a.seg"))
    await pool.wait_stores(1)
    await _put_blobs(pool, ["cor"], 4096)
    reply = await pool.bus.request("tandem.pool.master.get", PoolKeys(["cor"]), PoolGetReply)
    ((_, offset),) = [(r.store, r.offset) for r in reply.objects[0].replicas]
    corrupt_segment_file(tmp_path / "a.seg", offset, b"\xff" * 16)
    got, _ = await _get_all(pool, ["cor"], 4096)
    assert got[0].error == "checksum"
    assert await pool.client.batch_exists(["cor"]) == 0


async def test_read_that_outlives_its_lease_is_refused(pool_procs, nats_url):
    from tests.pool.conftest import master_and_client

    lease = ("--lease-ttl", "0.000001")
    async with master_and_client(pool_procs, nats_url, *lease, name="lease-test") as pool:
        pool_procs.store("store-a")
        await pool.wait_stores(1)
        await _put_blobs(pool, ["lease"], 1 << 20)
        got, _ = await _get_all(pool, ["lease"], 1 << 20)
        assert got[0].error == "lease_expired"


async def test_concurrent_puts_of_one_key_from_two_clients_yield_one_winner(pool, nats_url):
    import asyncio

    from libs.common.bus.connection import Bus
    from libs.common.pool.client import LocalMemory, PoolClient
    from libs.common.transfer import create_engine

    pool.procs.store("store-a")
    await pool.wait_stores(1)
    bus = Bus(nats_url, "second-client", connect_timeout=10, request_timeout=5)
    engine = create_engine("tcp", host="127.0.0.1")
    await bus.connect()
    await engine.start()
    try:
        other = PoolClient(bus, engine, timeout=10)
        buffer = engine.allocate(1 << 20)
        other_mem = LocalMemory.register(engine, buffer)
        buffer[:] = os.urandom(1 << 20)
        pool.fill(0, os.urandom(1 << 20))
        for round_ in range(5):
            key = f"race-{round_}"
            a, b = await asyncio.gather(
                pool.client.batch_put([key], pool.mem, [0], [1 << 20]),
                other.batch_put([key], other_mem, [0], [1 << 20]),
            )
            assert sorted([a[0].error, b[0].error]) == ["", "exists"]
            got, data = await _get_all(pool, [key], 1 << 20)
            winner = pool.read(0, 1 << 20) if a[0].ok else bytes(buffer)
            assert got[0].ok and data[0] == winner
    finally:
        await engine.stop()
        await bus.close()
