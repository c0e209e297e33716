"""A store with --segment-file keeps its objects across a restart (checksums verified)."""

import os

import pytest


@pytest.mark.slow
async def test_store_restart_with_a_segment_file_keeps_every_object(pool, tmp_path):
    seg = str(tmp_path / "store-a.seg")
    pool.procs.store("store-a", "--segment-file", seg, size="4MiB")
    await pool.wait_stores(1)
    keys = [f"sf-{i}" for i in range(20)]
    blobs = [os.urandom(8192) for _ in keys]
    for i, blob in enumerate(blobs):
        pool.fill(i * 8192, blob)
    put = await pool.client.batch_put(keys, pool.mem, [i * 8192 for i in range(20)], [8192] * 20)
    assert all(r.ok for r in put)
    assert pool.procs.stop("store-a") == 0  # graceful: unmount, index saved
    await pool.wait_stores(0)
    pool.procs.store("store-a", "--segment-file", seg, size="4MiB")
    await pool.wait_stores(1)
    await pool.wait_objects(len(keys))
    dst = [pool.half + i * 8192 for i in range(20)]
    got = await pool.client.batch_get(keys, pool.mem, dst, 8192)
    assert all(r.ok for r in got)
    assert [pool.read(d, 8192) for d in dst] == blobs


async def test_store_drops_an_object_whose_bytes_changed_while_it_was_down(pool, tmp_path):
    seg = tmp_path / "store-b.seg"
    pool.procs.store("store-b", "--segment-file", str(seg), size="1MiB")
    await pool.wait_stores(1)
    pool.fill(0, os.urandom(2 * 4096))
    assert all(r.ok for r in await pool.client.batch_put(["keep", "spoil"], pool.mem,
                                                         [0, 4096], [4096, 4096]))  # fmt: skip
    from libs.common.messages.pool import PoolGetReply, PoolKeys

    reply = await pool.bus.request("tandem.pool.master.get", PoolKeys(["spoil"]), PoolGetReply)
    offset = reply.objects[0].replicas[0].offset
    assert pool.procs.stop("store-b") == 0
    _spoil(seg, offset)  # bit rot while the store was down
    pool.procs.store("store-b", "--segment-file", str(seg), size="1MiB")
    await pool.wait_stores(1)
    await pool.wait_objects(1)
    assert await pool.client.batch_exists(["keep"]) == 1
    assert await pool.client.batch_exists(["spoil"]) == 0


def _spoil(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00" * 64)
