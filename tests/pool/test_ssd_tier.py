"""The SSD tier's parts alone: the store's files (services/cache_store/ssd.py) and the
master's choices (services/cache_master/tiers/ssd_index.py, the eviction's preference)."""

from __future__ import annotations

import os
import time

from libs.common.messages.pool import PoolRecord, PoolSsdOrder
from services.cache_master.metadata.metadata import PoolLimits, PoolMetadata
from services.cache_master.metadata.objects import PutSpec
from services.cache_master.tiers.ssd_index import (
    SsdCopy,
    SsdIndex,
    exists,
    plan_spills,
    reserve_promotions,
)
from services.cache_store.segment import checksum
from services.cache_store.ssd import SsdEntry, SsdTier
from services.cache_store.ssd_orders import serve_order
from tests.pool.test_eviction import UNIT, full_segment
from tests.pool.test_pool_ssd_faults import small_disk

# --- the store's files -----------------------------------------------------------------------


def _segment_with(blobs: list[bytes]) -> tuple[memoryview, list[PoolRecord]]:
    view = memoryview(bytearray(b"".join(blobs)))
    records, offset = [], 0
    for i, blob in enumerate(blobs):
        records.append(PoolRecord(f"k{i}", offset, len(blob), checksum(blob), ""))
        offset += len(blob)
    return view, records


def test_a_spilled_file_is_promoted_back_byte_equal_and_found_again_after_a_rescan(tmp_path):
    view, records = _segment_with([os.urandom(1000), os.urandom(3000)])
    tier = SsdTier(tmp_path, 1 << 20)
    tier.scan()
    for r in records:
        tier.add(r.key, tier.spill_io(view, r))
    target = memoryview(bytearray(4000))
    moved = PoolRecord("k1", 500, 3000, records[1].checksum, "")
    assert tier.promote_io(target, moved) == "done"
    assert bytes(target[500:3500]) == bytes(view[1000:4000])
    again = SsdTier(tmp_path, 1 << 20)
    assert again.scan() == 0
    assert sorted(again.entries) == ["k0", "k1"] and again.used == 4000


def test_a_promotion_no_longer_valid_reads_the_file_but_writes_nothing(tmp_path):
    view, records = _segment_with([os.urandom(1000)])
    tier = SsdTier(tmp_path, 1 << 20)
    tier.add("k0", tier.spill_io(view, records[0]))
    target = memoryview(bytearray(1000))
    assert tier.promote_io(target, records[0], valid=lambda: False) == "stale"
    assert bytes(target) == bytes(1000) and tier.path("k0").exists()


async def test_a_full_disk_degrades_the_tier_leaves_no_tmp_and_retries_later(tmp_path):
    with small_disk(tmp_path / "disk", "256k") as disk:  # 64 pages: 3 files of 17
        view, records = _segment_with([os.urandom(64 << 10) for _ in range(6)])
        tier = SsdTier(disk, 1 << 20, retry_s=3600)
        reply = await serve_order(tier, view, PoolSsdOrder(1, "spill", records[:4]))
        assert reply.done == ["k0", "k1", "k2"] and reply.dropped == []
        assert reply.degraded > 3000 and tier.write_errors == 1
        assert sorted(p.name for p in disk.iterdir()) == sorted(tier.path(k).name
                                                                for k in reply.done)  # fmt: skip
        tier.unlink(["k0"])  # room again, but the tier waits for its retry: no write
        tier.forget("k0")
        reply = await serve_order(tier, view, PoolSsdOrder(1, "spill", records[4:]))
        assert reply.done == [] and tier.write_errors == 1 and len(list(disk.iterdir())) == 2
        tier.degraded_until = time.monotonic()  # the retry interval is over
        reply = await serve_order(tier, view, PoolSsdOrder(1, "spill", records[4:]))
        assert reply.done == ["k4"] and reply.degraded > 0  # k5 found the disk full again
        assert not list(disk.glob("*.tmp")) and sorted(tier.entries) == ["k1", "k2", "k4"]


def test_bytes_that_changed_under_the_copy_are_not_spilled(tmp_path):
    view, records = _segment_with([os.urandom(1000)])
    view[10] ^= 0xFF  # the range was written again since the master chose it
    tier = SsdTier(tmp_path, 1 << 20)
    assert tier.spill_io(view, records[0]) is None
    assert list(tmp_path.iterdir()) == []


def test_a_rescan_drops_a_corrupted_file_a_stray_tmp_and_the_oldest_beyond_the_size(tmp_path):
    view, records = _segment_with([os.urandom(1000) for _ in range(4)])
    tier = SsdTier(tmp_path, 1 << 20)
    for i, r in enumerate(records):
        tier.add(r.key, tier.spill_io(view, r))
        os.utime(tier.path(r.key), (1000 + i, 1000 + i))  # k0 oldest
    with open(tier.path("k3"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if view[3999] else b"\x01")
    (tmp_path / "half.kv.tmp").write_bytes(b"x")
    small = SsdTier(tmp_path, 2000)  # --ssd-size shrank: room for two of the three good
    assert small.scan() == 2  # k3 (checksum) and k0 (the oldest over the bound)
    assert list(small.entries) == ["k1", "k2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [small.path("k1").name, small.path("k2").name]
    )


def test_reserve_forgets_the_oldest_first_and_refuses_what_can_never_fit(tmp_path):
    tier = SsdTier(tmp_path, 3000)
    for key in ("a", "b", "c"):
        tier.add(key, SsdEntry(1000, "0" * 16, ""))
    assert tier.reserve(1500, keep={"a"}) == ["b", "c"]
    assert tier.reserve(4000, keep=set()) is None


def test_a_key_that_is_not_a_file_name_still_gets_its_own_file(tmp_path):
    tier = SsdTier(tmp_path, 1 << 20)
    assert tier.path("..").parent == tmp_path and tier.path("x" * 256).parent == tmp_path
    assert tier.path("..") != tier.path(".")


# --- the master's choices -----------------------------------------------------------------


def test_eviction_takes_objects_with_an_ssd_copy_first_then_the_oldest_others():
    segment, lru, objects = full_segment(["a", "b", "c", "d"])
    spilled = {"c"}
    victims = lru.evict(segment, objects, now=0.0, low_watermark=0.5,
                        first=lambda obj: obj.key in spilled)  # fmt: skip
    assert [o.key for o in victims] == ["c", "a"]


def _meta_with(keys: list[str]) -> PoolMetadata:
    meta = PoolMetadata(PoolLimits(alignment=64, min_object_size=64))
    meta.mount("s0", {"region_id": 1, "length": len(keys) * UNIT}, [], 0.0)
    put_id, _ = meta.put_start([PutSpec(k, UNIT, "0123456789abcdef") for k in keys], 1, 0.0)
    meta.put_end(put_id, keys)
    return meta


def test_spills_cover_the_coldest_objects_above_the_watermark_and_skip_spilled_ones():
    meta = _meta_with(["a", "b", "c", "d"])  # full: 4 of 4 units
    index = SsdIndex()
    index.add("s0", "a", SsdCopy(UNIT, "0123456789abcdef"))
    planned = plan_spills(meta, index, meta.segments["s0"], 0.25, busy=set(), now=0.0)
    assert [r.key for r in planned] == ["b", "c"]  # a (spilled) + b + c = 3 units over 1


def test_a_key_on_ssd_only_is_present_and_a_get_reserves_its_promotion_on_that_store():
    meta = _meta_with(["a", "b"])
    index = SsdIndex()
    index.add("s0", "gone", SsdCopy(UNIT, "0123456789abcdef"))
    assert exists(meta, index, ["a", "gone", "b", "never"]) == 3
    meta.evict(meta.segments["s0"], 0.0, need=UNIT)  # make the room a promotion would
    (promotion,) = reserve_promotions(meta, index, ["a", "gone"], now=0.0)
    assert promotion.store_id == "s0" and [r.key for r in promotion.records] == ["gone"]
    assert not meta.objects["gone"].complete  # pending until the store has read it in
    assert meta.put_end(promotion.put_id, ["gone"]) == ["gone"]


def test_spills_skip_leased_objects_eviction_could_not_take_now():
    meta = _meta_with(["a", "b", "c", "d"])
    meta.objects["a"].lease_until = 10.0  # a reader holds it: eviction passes it by
    planned = plan_spills(meta, SsdIndex(), meta.segments["s0"], 0.5, busy=set(), now=1.0)
    assert [r.key for r in planned] == ["b", "c"]
