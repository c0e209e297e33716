"""The mount protocol on a real master: nothing is mounted before the end, chunks come in
order, the counts must match, and a chunk is bounded."""

import pytest

from libs.common.bus.connection import RemoteError
from libs.common.messages.mounts import (
    PoolMount,
    PoolMountChunk,
    PoolMountEnd,
    PoolMountPage,
    PoolMountReply,
)
from libs.common.messages.pool import MOUNT_CHUNK_RECORDS, PoolCount, PoolRecord

CK = "0123456789abcdef"


def _records(start: int, count: int) -> list[PoolRecord]:
    return [PoolRecord(f"m-{i}", i * 64, 64, CK) for i in range(start, start + count)]


async def _ask(pool, name, message, reply_type):
    return await pool.bus.request(f"tandem.pool.master.{name}", message, reply_type)


async def test_a_store_is_mounted_with_its_objects_only_after_the_last_chunk(pool):
    await pool.wait_stores(0)
    segment = pool.mem.region.to_dict()  # any valid descriptor; no bytes are read here
    begun = await _ask(pool, "mount", PoolMount("fake", segment, _records(0, 100)),
                       PoolMountReply)  # fmt: skip
    mid = begun.mount_id
    staged = await _ask(pool, "mount_chunk", PoolMountChunk("fake", mid, 1, _records(100, 100)),
                        PoolCount)  # fmt: skip
    assert staged.count == 200
    stats = await pool.client.stats()
    assert "fake" not in stats.stores and stats.objects == 0  # not before the end
    end = await _ask(pool, "mount_end", PoolMountEnd("fake", mid, 2, 200), PoolMountReply)
    assert end.pages == 1 and len(end.records) == 200 and end.epoch == stats.epoch
    stats = await pool.client.stats()
    assert stats.stores["fake"]["objects"] == 200 and stats.objects == 200
    assert await pool.client.batch_exists([f"m-{i}" for i in range(200)]) == 200
    with pytest.raises(RemoteError) as e:  # the one page came with the end: session gone
        await _ask(pool, "mount_page", PoolMountPage("fake", mid, 0), PoolMountReply)
    assert e.value.code == 404


async def test_out_of_order_chunks_and_wrong_counts_drop_the_mount(pool):
    await pool.wait_stores(0)
    segment = pool.mem.region.to_dict()
    mid = (await _ask(pool, "mount", PoolMount("fake", segment), PoolMountReply)).mount_id
    with pytest.raises(RemoteError) as e:
        await _ask(pool, "mount_chunk", PoolMountChunk("fake", mid, 2, _records(0, 1)), PoolCount)
    assert e.value.code == 409
    with pytest.raises(RemoteError) as e:  # the session is gone
        await _ask(pool, "mount_end", PoolMountEnd("fake", mid, 1, 0), PoolMountReply)
    assert e.value.code == 404
    mid = (await _ask(pool, "mount", PoolMount("fake", segment), PoolMountReply)).mount_id
    with pytest.raises(RemoteError, match="the end says 1 and 5") as e:
        await _ask(pool, "mount_end", PoolMountEnd("fake", mid, 1, 5), PoolMountReply)
    assert e.value.code == 409
    assert "fake" not in (await pool.client.stats()).stores


async def test_a_chunk_over_the_record_limit_is_refused_with_413(pool):
    await pool.wait_stores(0)
    segment = pool.mem.region.to_dict()
    big = [PoolRecord(f"{i:x}", 0, 64, CK) for i in range(MOUNT_CHUNK_RECORDS + 1)]
    with pytest.raises(RemoteError) as e:
        await _ask(pool, "mount", PoolMount("fake", segment, big), PoolMountReply)
    assert e.value.code == 413
