"""The control plane at scale: a store holding 100,000 objects re-mounts after a master
restart, in chunks within NATS's payload limit, and every object is known and readable.

The objects are real: a segment file of 100,000 objects of the minimum size (64 bytes)
and its index, written here the way a store saves them, so the store process starts
holding them (it checks every checksum) without 100,000 puts.
"""

import asyncio
import os
import time

import orjson
import pytest

from libs.common.messages.pool import PoolRecord, chunk_records
from services.cache_store.segment import INDEX_VERSION, checksum

OBJECTS = 100_000
SIZE = 64  # the master's default --min-object-size, one alignment unit
SEGMENT = 8 << 20


def _write_segment(path, count: int) -> tuple[list[str], bytes]:
    data = bytearray(os.urandom(count * SIZE)) + bytearray(SEGMENT - count * SIZE)
    keys = [f"{i:032x}" for i in range(count)]
    rows = [(k, i * SIZE, SIZE, checksum(data[i * SIZE : (i + 1) * SIZE]))
            for i, k in enumerate(keys)]  # fmt: skip
    path.write_bytes(data)
    index = {"v": INDEX_VERSION, "size": SEGMENT, "objects": rows}
    path.with_name(path.name + ".index.json").write_bytes(orjson.dumps(index))
    return keys, bytes(data)


def test_a_100k_object_report_is_cut_into_chunks_within_the_payload_limit():
    records = [PoolRecord(f"{i:032x}", i * SIZE, SIZE, "0" * 16) for i in range(OBJECTS)]
    chunks = chunk_records(records)
    assert sum(map(len, chunks)) == OBJECTS and len(chunks) > 1
    from libs.common.messages.mounts import PoolMountChunk

    biggest = max(len(PoolMountChunk("s", "m", 1, c).encode()) for c in chunks)
    assert biggest < 1 << 20
    long_keys = [PoolRecord("k" * 256, 0, SIZE, "0" * 16)] * 20_000
    assert max(len(PoolMountChunk("s", "m", 1, c).encode()) for c in chunk_records(long_keys)) < (
        1 << 20
    )


async def _wait_mounts(pool, sid: str, count: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in pool.procs.log(sid).splitlines() if "segment mounted" in line]
        if len(lines) >= count or time.monotonic() > deadline:
            assert len(lines) >= count, lines
            return lines
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_a_store_of_100k_objects_remounts_after_a_master_restart(pool, tmp_path):
    keys, data = _write_segment(tmp_path / "seg", OBJECTS)
    pool.procs.store("big", "--segment-file", str(tmp_path / "seg"), size="8MiB")
    await pool.wait_stores(1)
    await pool.wait_objects(OBJECTS, timeout=60)
    await _wait_mounts(pool, "big", 1)  # the store has read the master's whole list
    pool.procs.kill("master")
    restarted = time.monotonic()
    pool.procs.master()
    await pool.wait_stores(1, timeout=60)
    await pool.wait_objects(OBJECTS, timeout=60)
    remount_s = time.monotonic() - restarted
    stats = await pool.client.stats()
    assert stats.objects == OBJECTS and stats.stores["big"]["objects"] == OBJECTS
    assert await pool.client.batch_exists(keys) == OBJECTS
    got = []
    step = (16 << 20) // 2 // SIZE  # objects per get batch that fit the destination half
    for start in range(0, OBJECTS, step):
        part = keys[start : start + step]
        dst = [pool.half + i * SIZE for i in range(len(part))]
        results = await pool.client.batch_get(part, pool.mem, dst, SIZE)
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        got.append(pool.read(pool.half, len(part) * SIZE))
    assert b"".join(got) == data[: OBJECTS * SIZE]
    mounts = await _wait_mounts(pool, "big", 2)  # the first mount and the re-mount
    print(f"re-mount of {OBJECTS} objects: {remount_s:.2f}s from restart; {mounts[-1]}")
