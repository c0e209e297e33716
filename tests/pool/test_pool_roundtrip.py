"""Put/get round trips through a real master and stores: bytes, replicas, exists, stats."""

import os

SIZES = [64, 65, 127, 4096, 4097, 65536, 1 << 20, 3 * (1 << 20) + 5]


async def test_put_then_get_returns_the_same_bytes_for_many_sizes(pool):
    pool.procs.store("store-a")
    pool.procs.store("store-b")
    await pool.wait_stores(2)
    blobs, offsets, off = [os.urandom(n) for n in SIZES], [], 0
    for blob in blobs:
        pool.fill(off, blob)
        offsets.append(off)
        off += len(blob) + 100
    keys = [f"rt-{n}" for n in SIZES]
    put = await pool.client.batch_put(keys, pool.mem, offsets, [len(b) for b in blobs])
    assert [r.error for r in put] == [""] * len(keys)
    dst = [pool.half + o for o in offsets]
    got = await pool.client.batch_get(keys, pool.mem, dst, [len(b) for b in blobs])
    assert [(r.ok, r.size) for r in got] == [(True, len(b)) for b in blobs]
    for blob, d in zip(blobs, dst, strict=True):
        assert pool.read(d, len(blob)) == blob


async def test_replicas_land_on_distinct_stores(pool):
    for sid in ("store-a", "store-b", "store-c"):
        pool.procs.store(sid)
    await pool.wait_stores(3)
    pool.fill(0, os.urandom(4096 * 8))
    keys = [f"rep-{i}" for i in range(8)]
    put = await pool.client.batch_put(keys, pool.mem, [4096 * i for i in range(8)], [4096] * 8,
                                      replicas=2)  # fmt: skip
    assert all(r.ok for r in put)
    stats = await pool.client.stats()
    assert sum(s["objects"] for s in stats.stores.values()) == 16
    from libs.common.messages.pool import PoolGetReply, PoolKeys

    reply = await pool.bus.request("tandem.pool.master.get", PoolKeys(keys), PoolGetReply)
    for found in reply.objects:
        stores = [r.store for r in found.replicas]
        assert len(stores) == 2 and len(set(stores)) == 2


async def test_exists_counts_leading_present_keys_only(pool):
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    pool.fill(0, os.urandom(3 * 4096))
    await pool.client.batch_put(["e0", "e1", "e3"], pool.mem, [0, 4096, 8192], [4096] * 3)
    assert await pool.client.batch_exists(["e0", "e1", "e2", "e3"]) == 2
    assert await pool.client.batch_exists(["e2", "e0"]) == 0
    assert await pool.client.batch_exists([]) == 0


async def test_put_of_an_existing_key_answers_exists_and_keeps_the_first_bytes(pool):
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    first, second = os.urandom(4096), os.urandom(4096)
    pool.fill(0, first)
    pool.fill(4096, second)
    assert (await pool.client.batch_put(["dup"], pool.mem, [0], [4096]))[0].ok
    again = await pool.client.batch_put(["dup"], pool.mem, [4096], [4096])
    assert again[0].error == "exists"
    got = await pool.client.batch_get(["dup"], pool.mem, [pool.half], 4096)
    assert got[0].ok and pool.read(pool.half, 4096) == first


async def test_get_of_a_missing_key_is_a_miss_and_counted(pool):
    pool.procs.store("store-a")
    await pool.wait_stores(1)
    got = await pool.client.batch_get(["nope"], pool.mem, [pool.half], 4096)
    assert got[0].error == "missing"
    assert (await pool.client.stats()).misses == 1
