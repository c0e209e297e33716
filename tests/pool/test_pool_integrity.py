"""KV integrity against forgery, on a real nats-server, master and stores: only bytes
tagged with the cluster secret are served; a bad copy falls through to a good replica; a
client with the wrong secret reads misses and deletes nothing."""

import contextlib
import os

import pytest

from libs.common.bus.connection import Bus
from libs.common.messages.pool import PoolGetReply, PoolKeys
from libs.common.pool.client import PoolClient
from libs.common.pool.integrity import KvMac
from libs.common.transfer import create_engine
from tests.pool.conftest import PoolHarness, corrupt_segment_file

SECRET = b"cluster secret: 32 random bytes!"
WRONG = b"a wrong secret, also of 32 bytes"
SIZE = 64 << 10


@contextlib.asynccontextmanager
async def harness(procs, nats_url, name, mac):
    """A client (own bus connection, tcp engine, 16 MiB buffer) with `mac` (None: off)."""
    bus = Bus(nats_url, name, connect_timeout=10, request_timeout=5)
    engine = create_engine("tcp", host="127.0.0.1")
    await bus.connect()
    await engine.start()
    try:
        yield PoolHarness(procs, bus, engine, PoolClient(bus, engine, timeout=10, mac=mac))
    finally:
        await engine.stop()
        await bus.close()


async def put(h, keys, replicas=0):
    blobs = [os.urandom(SIZE) for _ in keys]
    for i, blob in enumerate(blobs):
        h.fill(i * SIZE, blob)
    res = await h.client.batch_put(keys, h.mem, [i * SIZE for i in range(len(keys))],
                                   [SIZE] * len(keys), replicas=replicas)  # fmt: skip
    assert all(r.ok for r in res), res
    return blobs


async def get(h, keys):
    dst = [h.half + i * SIZE for i in range(len(keys))]
    got = await h.client.batch_get(keys, h.mem, dst, SIZE)
    return [r.error for r in got], [h.read(d, SIZE) for d in dst]


async def where(h, key):
    reply = await h.bus.request("tandem.pool.master.get", PoolKeys([key]), PoolGetReply)
    return [(r.store, r.offset) for r in reply.objects[0].replicas], reply.segments


@pytest.fixture
async def cluster(pool_procs, nats_url):
    """Master and two stores; `good` holds the cluster secret."""
    pool_procs.master()
    pool_procs.store("store-a")
    pool_procs.store("store-b")
    async with harness(pool_procs, nats_url, "good", KvMac(SECRET)) as good:
        await good.wait_stores(2)
        yield good


async def test_a_forged_tag_claiming_the_cluster_key_is_never_served_and_is_dropped(
    cluster, pool_procs, nats_url
):
    forger_mac = KvMac(WRONG)
    forger_mac.key_id = KvMac(SECRET).key_id  # claims the cluster's key, cannot make its MAC
    async with harness(pool_procs, nats_url, "forger", forger_mac) as forger:
        await put(forger, ["real-page"], replicas=2)
    errors, _ = await get(cluster, ["real-page"])
    assert errors == ["mac"]
    # Provably forged on both replicas: dropped, so the real bytes can be written.
    assert await cluster.client.batch_exists(["real-page"]) == 0
    blobs = await put(cluster, ["real-page"])
    errors, data = await get(cluster, ["real-page"])
    assert errors == [""] and data == blobs


async def test_an_untagged_forged_put_is_a_miss_for_every_secret_holder(
    cluster, pool_procs, nats_url
):
    async with harness(pool_procs, nats_url, "forger", None) as forger:  # integrity off
        await put(forger, ["page-x"])
    errors, _ = await get(cluster, ["page-x"])  # the bytes read are not to be used
    assert errors == ["mac"]
    # Not provably forged (no tag of this secret): a reader does not delete it.
    assert await cluster.client.batch_exists(["page-x"]) == 1


@pytest.mark.parametrize("secret", [SECRET, None], ids=["mac", "checksum"])
async def test_a_bad_first_replica_falls_through_to_the_good_second(
    pool_procs, nats_url, secret, tmp_path
):
    pool_procs.master()
    for sid in ("store-a", "store-b"):
        pool_procs.store(sid, "--segment-file", str(tmp_path / f"{sid}.seg"))
    async with harness(pool_procs, nats_url, "reader", secret and KvMac(secret)) as h:
        await h.wait_stores(2)
        blobs = await put(h, ["fall"], replicas=2)
        replicas, _ = await where(h, "fall")
        (store, offset), _ = replicas  # the replica a get reads first
        corrupt_segment_file(tmp_path / f"{store}.seg", offset, b"\x66" * 64)  # gone bad
        errors, data = await get(h, ["fall"])
        assert errors == [""] and data == blobs
        after, _ = await where(h, "fall")
        assert (store, offset) not in after  # the bad replica was dropped, the good kept
        errors, data = await get(h, ["fall"])
        assert errors == [""] and data == blobs


async def test_a_client_with_the_wrong_secret_reads_only_misses_and_deletes_nothing(
    cluster, pool_procs, nats_url
):
    keys = [f"wk-{i}" for i in range(8)]
    blobs = await put(cluster, keys, replicas=2)
    async with harness(pool_procs, nats_url, "wrong", KvMac(WRONG)) as wrong:
        errors, _ = await get(wrong, keys)
        assert errors == ["mac"] * len(keys)
    errors, data = await get(cluster, keys)
    assert errors == [""] * len(keys) and data == blobs
    for key in keys:
        assert len((await where(cluster, key))[0]) == 2


async def test_tags_survive_a_master_kill_9_through_the_stores_indexes(cluster):
    keys = [f"mk-{i}" for i in range(8)]
    blobs = await put(cluster, keys)
    cluster.procs.kill("master")
    cluster.procs.master()
    await cluster.wait_stores(2)
    await cluster.wait_objects(len(keys))
    errors, data = await get(cluster, keys)
    assert errors == [""] * len(keys) and data == blobs


async def test_a_drop_that_matches_no_record_drops_nothing(cluster):
    from libs.common.messages.pool import PoolBadCopy, PoolCount, PoolDrop

    blobs = await put(cluster, ["keep"])
    (store, offset), *_ = (await where(cluster, "keep"))[0]
    wrong = [PoolBadCopy("keep", store, offset + 64, "0" * 16),  # another range
             PoolBadCopy("keep", store, offset, "0" * 16),  # another checksum and tag
             PoolBadCopy("nothing-here", store, offset, "0" * 16)]  # fmt: skip
    reply = await cluster.bus.request("tandem.pool.master.drop", PoolDrop(wrong), PoolCount)
    assert reply.count == 0
    errors, data = await get(cluster, ["keep"])
    assert errors == [""] and data == blobs
