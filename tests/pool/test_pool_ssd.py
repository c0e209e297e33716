"""The SSD tier under a store's DRAM segment, on a real nats-server, master and store: objects
beyond DRAM spill to files and are read back exactly (MAC verified); a restarted store
re-indexes its files; a corrupted file is dropped, never served; --ssd-size is a bound."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import orjson
import pytest
import xxhash

from libs.common.bus.connection import Bus
from libs.common.pool.client import PoolClient
from libs.common.pool.integrity import KvMac
from libs.common.transfer import create_engine
from tests.pool.conftest import PoolHarness

SECRET = b"cluster secret: 32 random bytes!"
SIZE = 64 << 10  # 16 objects fill the 1 MiB segment
COUNT = 24  # the working set: 1.5x DRAM
MASTER = ("--lease-ttl", "0.5", "--max-lease-pin", "5")


@contextlib.asynccontextmanager
async def ssd_pool(procs, nats_url, tmp_path, *store_args, ssd_size="16MiB"):
    """A master, store `s1` (1 MiB of DRAM, an SSD tier in tmp_path/ssd) and a client with
    the cluster secret (every get verifies the MAC tag)."""
    procs.master(*MASTER)
    ssd = tmp_path / "ssd"
    args = ("--ssd-dir", str(ssd), "--ssd-size", ssd_size, *store_args)
    procs.store("s1", *args, size="1MiB")
    bus = Bus(nats_url, "ssd-test-client", connect_timeout=10, request_timeout=5)
    engine = create_engine("tcp", host="127.0.0.1")
    await bus.connect()
    await engine.start()
    try:
        h = PoolHarness(procs, bus, engine, PoolClient(bus, engine, timeout=10, mac=KvMac(SECRET)))
        h.ssd, h.store_args = ssd, args
        await h.wait_stores(1)
        await _until(lambda: _ssd_tiers(h), "the store's ssd tier reported")
        yield h
    finally:
        await engine.stop()
        await bus.close()


async def _ssd_tiers(h) -> bool:
    return (await h.client.stats()).ssd.get("tiers", 0) == 1


async def _until(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if await check():
                return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"not within {timeout}s: {what}")


async def put_one_by_one(h, keys) -> dict[str, bytes]:
    """Put each key alone (a workload's write-backs come over time, not in one batch)."""
    blobs = {}
    for key in keys:
        blob = os.urandom(SIZE)
        h.fill(0, blob)
        (res,) = await h.client.batch_put([key], h.mem, [0], [SIZE])
        assert res.ok, res
        blobs[key] = blob
    return blobs


async def read_back(h, keys, chunk: int = 6) -> dict[str, bytes | None]:
    """Get `keys` a few at a time (promotion needs DRAM, and a read leases it), each chunk
    after the previous chunk's lease ended; a miss is None."""
    out: dict[str, bytes | None] = {}
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        dst = [h.half + i * SIZE for i in range(len(part))]
        got = await h.client.batch_get(part, h.mem, dst, SIZE)
        for key, r, d in zip(part, got, dst, strict=True):
            out[key] = h.read(d, SIZE) if r.ok else None
        await asyncio.sleep(0.6)  # the lease (MASTER: 0.5 s)
    return out


def rot(path, offset: int, count: int) -> None:
    """Flip `count` bytes of a file from `offset` (negative: from its end)."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        where = f.tell()
        data = f.read(count)
        f.seek(where)
        f.write(bytes(b ^ 0xFF for b in data))


async def spills_settled(h, keys) -> bool:
    """No spill is under way: the master knows a copy for each file on the SSD (a file
    taken while being written would be cut by a kill -9, and dropped at the re-index)."""
    files = sum(ssd_file(h, k).exists() for k in keys)
    return (await h.client.stats()).ssd.get("copies", 0) == files > 0


def ssd_file(h, key: str):
    return h.ssd / f"{xxhash.xxh3_128_hexdigest(key.encode())}.kv"


async def test_objects_beyond_dram_spill_to_ssd_and_are_read_back_exactly(pool_procs, nats_url,
                                                                          tmp_path):  # fmt: skip
    async with ssd_pool(pool_procs, nats_url, tmp_path) as h:
        events: list[dict] = []

        async def on_event(msg) -> None:
            events.append(orjson.loads(msg.data))

        sub = await h.bus.nc.subscribe("tandem.kv.events.s1", cb=on_event)
        keys = [f"spill-{i:02d}" for i in range(COUNT)]
        blobs = await put_one_by_one(h, keys)
        stats = await h.client.stats()
        assert stats.objects < COUNT, "the working set fits in DRAM: nothing to test"
        assert stats.ssd["spilled"] > 0 and stats.ssd["only"] > 0
        assert await h.client.batch_exists(keys) == COUNT  # DRAM or SSD, every one present
        got = await read_back(h, keys)
        assert got == blobs  # bytes equal, and each MAC tag verified (ok)
        stats = await h.client.stats()
        assert stats.ssd["promoted"] > 0
        await sub.unsubscribe()
        ssd_stored = {k for e in events if e["tier"] == "ssd" and e["kind"] == "stored"
                      for k in e["keys"]}  # fmt: skip
        pool_stored = [k for e in events if e["tier"] == "pool" and e["kind"] == "stored"
                       for k in e["keys"]]  # fmt: skip
        assert ssd_stored and ssd_stored <= set(keys)
        promoted_again = [k for k in ssd_stored if pool_stored.count(k) >= 2]
        assert promoted_again, "a promotion publishes tier `pool` again"


@pytest.mark.slow
async def test_a_restarted_store_reindexes_its_ssd_tier_and_serves_it(pool_procs, nats_url,
                                                                       tmp_path):  # fmt: skip
    async with ssd_pool(pool_procs, nats_url, tmp_path) as h:
        keys = [f"restart-{i:02d}" for i in range(COUNT)]
        blobs = await put_one_by_one(h, keys)
        await _until(lambda: spills_settled(h, keys), "the spills settle")
        on_ssd = [k for k in keys if ssd_file(h, k).exists()]
        assert len(on_ssd) >= COUNT - 16
        pool_procs.kill("s1")  # kill -9: DRAM (anonymous) is lost, the files stay
        await h.wait_stores(0, timeout=15)
        pool_procs.store("s1", *h.store_args, size="1MiB")
        await h.wait_stores(1)
        await _until(lambda: _ssd_tiers(h), "the restarted store's tier reported")
        got = await read_back(h, on_ssd)
        assert got == {k: blobs[k] for k in on_ssd}
        assert "ssd tier indexed" in pool_procs.log("s1")


async def test_a_corrupted_ssd_file_is_dropped_not_served(pool_procs, nats_url, tmp_path):
    async with ssd_pool(pool_procs, nats_url, tmp_path) as h:
        keys = [f"rot-{i:02d}" for i in range(COUNT)]
        blobs = await put_one_by_one(h, keys)
        oldest = keys[:4]  # evicted from DRAM first: on SSD only now
        assert all(ssd_file(h, k).exists() for k in oldest)
        for key in oldest[:2]:  # bit rot: the last byte of the object's bytes
            rot(ssd_file(h, key), -1, 1)
        got = await read_back(h, oldest)
        assert got[oldest[0]] is None and got[oldest[1]] is None  # a miss, never bad bytes
        assert got[oldest[2]] == blobs[oldest[2]] and got[oldest[3]] == blobs[oldest[3]]
        assert not ssd_file(h, oldest[0]).exists()  # deleted by the store
        assert await h.client.batch_exists([oldest[0]]) == 0  # and the master forgot it
        assert (await h.client.stats()).ssd["dropped"] >= 2
        # At rest while the store is down: the restart's scan drops it.
        victim = next(k for k in keys[4:] if ssd_file(h, k).exists())
        pool_procs.stop("s1")
        await h.wait_stores(0, timeout=15)
        rot(ssd_file(h, victim), -SIZE // 2, 64)
        pool_procs.store("s1", *h.store_args, size="1MiB")
        await h.wait_stores(1)
        await _until(lambda: _ssd_tiers(h), "the restarted store's tier reported")
        assert not ssd_file(h, victim).exists()
        assert await h.client.batch_exists([victim]) == 0


async def test_ssd_size_bounds_the_tier_oldest_files_dropped_and_master_told(pool_procs,
                                                                             nats_url,
                                                                             tmp_path):  # fmt: skip
    async with ssd_pool(pool_procs, nats_url, tmp_path, ssd_size="256KiB") as h:
        keys = [f"bound-{i:02d}" for i in range(COUNT + 8)]
        await put_one_by_one(h, keys)

        async def settled() -> bool:  # the last spill order answered
            return (await h.client.stats()).ssd["copies"] == len(list(h.ssd.glob("*.kv")))

        await _until(settled, "the master's count of SSD copies equal to the files")
        files = list(h.ssd.glob("*.kv"))
        assert 0 < len(files) <= 4  # 4 objects of 64 KiB
        stats = await h.client.stats()
        assert stats.ssd["dropped"] > 0
        assert await h.client.batch_exists([keys[0]]) == 0  # spilled first, dropped first
        on_disk = {k for k in keys if ssd_file(h, k).exists()}
        assert on_disk and keys[0] not in on_disk


@pytest.mark.slow
async def test_a_new_master_learns_the_ssd_tier_from_the_stores_report(pool_procs, nats_url,
                                                                        tmp_path):  # fmt: skip
    async with ssd_pool(pool_procs, nats_url, tmp_path) as h:
        keys = [f"master-{i:02d}" for i in range(COUNT)]
        blobs = await put_one_by_one(h, keys)
        await _until(lambda: spills_settled(h, keys), "the spills settle")
        on_ssd = [k for k in keys if ssd_file(h, k).exists()]
        pool_procs.kill("master")
        pool_procs.master(*MASTER)  # metadata empty: the store mounts and reports again
        await h.wait_stores(1)

        async def known() -> bool:  # the new master may order more spills: at least these
            return (await h.client.stats()).ssd.get("copies", 0) >= len(on_ssd)

        await _until(known, "the new master knows every SSD copy")
        assert await h.client.batch_exists(on_ssd) == len(on_ssd)
        assert await read_back(h, on_ssd) == {k: blobs[k] for k in on_ssd}
