"""The master's rules, pure Python with a hand-driven clock: visibility, leases, eviction."""

import pytest

from libs.common.messages.pool import PoolRecord
from services.cache_master.ha.repair_plan import finish_repair, plan_repairs
from services.cache_master.metadata.metadata import PoolLimits, PoolMetadata
from services.cache_master.metadata.objects import PoolRequestError, PutSpec

CK = "0123456789abcdef"
UNIT = 4096


def meta_with(stores: int, units: int = 10, **limits) -> PoolMetadata:
    meta = PoolMetadata(PoolLimits(**limits))
    for i in range(stores):
        meta.mount(f"s{i}", {"region_id": 100 + i, "length": units * UNIT}, [], now=0.0)
    return meta


def put(meta: PoolMetadata, keys, now=0.0, replicas=0, size=UNIT):
    put_id, results = meta.put_start([PutSpec(k, size, CK) for k in keys], replicas, now)
    ok = [k for k, status, _ in results if status == "ok"]
    meta.put_end(put_id, ok)
    return {k: status for k, status, _ in results}


def test_pending_object_is_invisible_until_put_end():
    meta = meta_with(1)
    put_id, _ = meta.put_start([PutSpec("k", UNIT, CK)], 0, 0.0)
    assert meta.exists(["k"]) == 0 and meta.get(["k"], 0.0) == [("k", None, "")]
    meta.put_end(put_id, ["k"])
    assert meta.exists(["k"]) == 1


def test_put_end_with_another_put_id_does_not_publish():
    meta = meta_with(1)
    meta.put_start([PutSpec("k", UNIT, CK)], 0, 0.0)
    assert meta.put_end("someone-else", ["k"]) == []
    assert meta.exists(["k"]) == 0


def test_second_put_of_a_pending_key_answers_exists():
    meta = meta_with(1)
    meta.put_start([PutSpec("k", UNIT, CK)], 0, 0.0)
    _, results = meta.put_start([PutSpec("k", UNIT, CK)], 0, 0.0)
    assert results[0][1] == "exists"


def test_unfinished_put_is_reclaimed_after_its_timeout():
    meta = meta_with(1, put_timeout=5.0)
    meta.put_start([PutSpec("k", UNIT, CK)], 0, 0.0)
    assert meta.expire_puts(4.0) == 0
    assert meta.expire_puts(6.0) == 1
    assert meta.segments["s0"].used == 0 and "k" not in meta.objects


def test_revoke_frees_the_ranges():
    meta = meta_with(1)
    put_id, _ = meta.put_start([PutSpec("k", UNIT, CK)], 0, 0.0)
    assert meta.put_revoke(put_id, ["k"]) == 1
    assert meta.segments["s0"].used == 0


def test_replicas_are_on_distinct_stores_and_capped_by_store_count():
    meta = meta_with(2)
    _, results = meta.put_start([PutSpec("k", UNIT, CK)], 3, 0.0)
    stores = [r.store_id for r in results[0][2]]
    assert sorted(stores) == ["s0", "s1"]


def test_bad_sizes_and_keys_refuse_the_whole_batch():
    meta = meta_with(1, max_object_size=8 * UNIT)
    for spec, code in [
        (PutSpec("k", -1, CK), 400),
        (PutSpec("k", 0, CK), 400),
        (PutSpec("k", 9 * UNIT, CK), 413),
        (PutSpec("bad key", UNIT, CK), 400),
        (PutSpec("k", UNIT, "xyz"), 400),
    ]:
        with pytest.raises(PoolRequestError) as e:
            meta.put_start([PutSpec("fine", UNIT, CK), spec], 0, 0.0)
        assert e.value.code == code
    assert not meta.objects  # nothing reserved


def test_eviction_frees_least_recently_used_first_and_stops_at_the_low_watermark():
    meta = meta_with(1, units=10, high_watermark=0.9, low_watermark=0.5)
    put(meta, [f"k{i}" for i in range(9)], now=0.0)
    meta.get(["k0"], now=100.0)  # k0 becomes the most recent; lease ends at 110
    assert put(meta, ["k9"], now=200.0) == {"k9": "ok"}  # 100% > 90%: evict to 50%
    assert list(meta.lru) == ["k6", "k7", "k8", "k0", "k9"]  # k1..k5, the oldest, went
    assert meta.evictions == 5 and meta.segments["s0"].use == 0.5


def test_eviction_skips_leased_objects_and_takes_younger_unleased_ones():
    meta = meta_with(1, units=4, lease_ttl=10.0, high_watermark=1.0)
    put(meta, ["a", "b"], now=0.0)
    meta.get(["a", "b"], now=1.0)  # leased until 11
    put(meta, ["c", "d"], now=2.0)  # full; a and b are the oldest
    assert put(meta, ["e"], now=5.0) == {"e": "ok"}  # needs one unit: one victim
    assert list(meta.lru) == ["a", "b", "d", "e"]  # c, the oldest unleased, went
    assert meta.evictions == 1


def test_eviction_never_frees_a_leased_object():
    meta = meta_with(1, units=4, lease_ttl=10.0)
    put(meta, ["a", "b", "c", "d"], now=0.0)
    meta.get(["a", "b", "c", "d"], now=1.0)  # all leased until 11
    assert put(meta, ["e"], now=2.0) == {"e": "full"}
    assert set(meta.lru) == {"a", "b", "c", "d"}
    assert put(meta, ["e"], now=12.0) == {"e": "ok"}


def test_remove_under_lease_hides_at_once_and_frees_after_the_lease():
    meta = meta_with(1, lease_ttl=10.0)
    put(meta, ["k"])
    meta.get(["k"], now=1.0)
    assert meta.remove(["k"], now=2.0) == 1
    assert meta.exists(["k"]) == 0 and meta.segments["s0"].used == UNIT
    meta.reap(now=5.0)
    assert meta.segments["s0"].used == UNIT
    meta.reap(now=12.0)
    assert meta.segments["s0"].used == 0


def test_silent_store_loses_its_replicas_and_the_others_stay():
    meta = meta_with(2)
    put(meta, ["k"], replicas=2)
    meta.heartbeat("s1", 101, now=8.0)
    assert meta.expire_stores(now=12.0, timeout=10.0) == ["s0"]
    assert [r.store_id for r in meta.objects["k"].replicas] == ["s1"]
    assert meta.expire_stores(now=30.0, timeout=10.0) == ["s1"]
    assert meta.exists(["k"]) == 0


def test_mount_of_a_new_region_replaces_and_same_region_merges():
    meta = meta_with(1)
    put(meta, ["a", "b"])
    offsets = {k: meta.objects[k].replicas[0].offset for k in ("a", "b")}
    # Same region: a report that lacks "b" keeps it (the store missed an update).
    meta.mount("s0", {"region_id": 100, "length": 10 * UNIT}, [], now=1.0)
    assert meta.exists(["a", "b"]) == 2
    # New region (the store restarted): only what it reports survives.
    report = [PoolRecord("a", offsets["a"], UNIT, CK)]
    meta.mount("s0", {"region_id": 999, "length": 10 * UNIT}, report, now=2.0)
    assert meta.exists(["a"]) == 1 and meta.exists(["b"]) == 0


def test_restarted_master_rebuilds_from_store_reports_and_refuses_conflicts():
    meta = meta_with(0)
    good = PoolRecord("k", 0, UNIT, CK)
    overlapping = PoolRecord("j", 64, UNIT, CK)
    other_bytes = PoolRecord("k", 2 * UNIT, UNIT, "fedcba9876543210")
    _, rejected = meta.mount("s0", {"region_id": 1, "length": 10 * UNIT}, [good, overlapping],
                             now=0.0)  # fmt: skip
    assert rejected == 1
    _, rejected = meta.mount("s1", {"region_id": 2, "length": 10 * UNIT}, [other_bytes], now=0)
    assert rejected == 1 and meta.exists(["k"]) == 1


def test_changes_report_visible_and_removed_objects_per_store():
    meta = meta_with(2)
    meta.take_changes()
    put(meta, ["k"], replicas=2)
    changes = meta.take_changes()
    assert sorted(changes.added) == ["s0", "s1"] and not changes.removed
    meta.remove(["k"], now=100.0)
    changes = meta.take_changes()
    assert changes.removed == {"s0": ["k"], "s1": ["k"]}


def test_objects_below_the_minimum_size_are_refused_in_puts_and_mount_reports():
    meta = meta_with(1, min_object_size=128)
    with pytest.raises(PoolRequestError, match="minimum object size 128") as e:
        meta.put_start([PutSpec("k", 127, CK)], 0, 0.0)
    assert e.value.code == 400
    small = PoolRecord("small", 0, 64, CK)
    assert meta.mount("s0", {"region_id": 100, "length": 10 * UNIT}, [small], 1.0)[1] == 1


def test_a_client_over_its_pending_cap_is_refused_and_others_are_not():
    meta = meta_with(1, units=64, max_pending_puts=4)
    put_id, _ = meta.put_start([PutSpec(f"a{i}", UNIT, CK) for i in range(3)], 0, 0.0, "a")
    with pytest.raises(PoolRequestError, match="limit 4") as e:
        meta.put_start([PutSpec("a9", UNIT, CK), PutSpec("a8", UNIT, CK)], 0, 0.0, "a")
    assert e.value.code == 429
    meta.put_start([PutSpec(f"b{i}", UNIT, CK) for i in range(4)], 0, 0.0, "b")  # another
    meta.put_end(put_id, ["a0"])
    meta.put_revoke(put_id, ["a1"])
    assert meta.pending_by_client["a"] == 1  # a2 only
    meta.put_start([PutSpec("a9", UNIT, CK), PutSpec("a8", UNIT, CK)], 0, 0.0, "a")
    assert meta.expire_puts(1000.0) == 7 and meta.pending_by_client == {}


def test_an_object_is_never_leased_without_a_break_past_max_lease_pin():
    meta = meta_with(1, lease_ttl=10.0, max_lease_pin=25.0)
    put(meta, ["k"])
    for now in (0.0, 5.0, 10.0, 15.0):  # each lease would end by 25
        assert meta.get(["k"], now)[0][2] == ""
    assert meta.get(["k"], 16.0)[0] == ("k", None, "pinned")  # would end at 26
    assert meta.objects["k"].lease_until == 25.0
    assert meta.get(["k"], 25.5)[0][2] == ""  # the lease ended: a new one begins


def test_a_lost_store_s_objects_get_one_more_replica_on_a_store_without_one():
    meta = meta_with(3, replicas=2)
    put(meta, [f"k{i}" for i in range(6)])
    lost = set(meta.segments["s0"].keys)
    assert lost
    meta.segments["s1"].last_seen = meta.segments["s2"].last_seen = 50.0
    assert meta.expire_stores(55.0, timeout=10.0) == ["s0"]  # silent since 0
    assert meta.under_replicated == lost
    repairs = plan_repairs(meta, 0.0, limit=100)
    assert {r.obj.key for r in repairs} == lost
    for r in repairs:
        assert r.target.store_id not in {x.store_id for x in r.obj.replicas}
        assert r.source.store_id != "s0"
    meta.take_changes()
    assert all(finish_repair(meta, r, copied=True) for r in repairs)
    assert all(len(meta.objects[k].replicas) == 2 for k in lost)
    assert set(meta.take_changes().added) <= {"s1", "s2"} and meta.repaired == len(lost)


def test_a_failed_copy_frees_its_range_is_retried_then_waits_for_a_mount():
    meta = meta_with(3, replicas=2)
    put(meta, ["k"])
    holder = meta.objects["k"].replicas[0].store_id
    meta.unmount(holder)
    (repair,) = plan_repairs(meta, 0.0, limit=10)
    used = repair.target.used
    assert not finish_repair(meta, repair, copied=False)
    assert repair.target.used == used - UNIT and meta.under_replicated == {"k"}  # retried
    for _ in range(2):
        (repair,) = plan_repairs(meta, 0.0, limit=10)
        assert not finish_repair(meta, repair, copied=False)
    assert meta.under_replicated == set() and meta.unplaced == {"k"}  # 3 failures: wait
    meta.mount("s9", {"region_id": 9, "length": 10 * UNIT}, [], 1.0)
    assert meta.under_replicated == {"k"}
