"""Soft pins' policy (services/cache_master/pins/book.py), pure Python on real metadata: eviction
skips held replicas, the bound holds and refuses, TTLs end pins."""

import pytest

from services.cache_master.config import CacheMasterConfig
from services.cache_master.metadata.metadata import PoolLimits, PoolMetadata
from services.cache_master.metadata.objects import PoolRequestError, PutSpec
from services.cache_master.pins.book import Pin, PinBook, PinLimits

CK = "0123456789abcdef"
UNIT = 4096
NOW = 1_000_000.0  # unix seconds: pins expire by the wall clock


def pool(units: int = 10, stores: int = 1, fraction: float = 0.25, **limits):
    meta = PoolMetadata(PoolLimits(**limits))
    for i in range(stores):
        meta.mount(f"s{i}", {"region_id": 100 + i, "length": units * UNIT}, [], now=0.0)
    book = PinBook(PinLimits(max_fraction=fraction, max_pins=3, max_ttl=3600.0))
    meta.keep = book.holds
    return meta, book


def put(meta: PoolMetadata, book: PinBook, keys, now=0.0):
    """One put per key, as a stream of worker write-backs."""
    for key in keys:
        put_id, results = meta.put_start([PutSpec(key, UNIT, CK)], 0, now)
        for visible in meta.put_end(put_id, [k for k, status, _ in results if status == "ok"]):
            if book.pinned(visible):  # what the service does after a put_end (pins/endpoints.py)
                book.hold(meta.objects[visible], meta.segments)


def pin(meta, book, keys, ttl=60.0, now=NOW):
    p = book.add(keys, ttl, now, meta.objects, meta.segments)
    book.refresh(meta.objects, meta.segments)
    return p


def test_eviction_skips_pinned_objects_and_takes_younger_unpinned_ones():
    meta, book = pool()
    put(meta, book, ["sys0", "sys1"])  # the oldest: LRU would take them first
    pin(meta, book, ["sys0", "sys1"])
    put(meta, book, [f"k{i}" for i in range(30)], now=1.0)  # 3x the segment
    assert meta.exists(["sys0", "sys1"]) == 2
    assert meta.evictions >= 20 and meta.segments["s0"].used <= 10 * UNIT


def test_a_key_pinned_before_its_put_is_held_from_its_put_end():
    meta, book = pool()
    put(meta, book, ["other"])  # the pool's object size prices the absent keys
    pin(meta, book, ["later0", "later1"])
    put(meta, book, ["later0", "later1"])
    put(meta, book, [f"k{i}" for i in range(30)], now=1.0)
    assert meta.exists(["later0", "later1"]) == 2


def test_held_bytes_never_exceed_the_fraction_of_each_segment():
    meta, book = pool(fraction=0.25)  # 10 units: 2.5 held at most
    put(meta, book, ["a"])
    pin(meta, book, ["a", "b"])
    put(meta, book, ["b", "c"])
    book.restore(Pin("x", ("c",), NOW + 60, NOW))  # a saved pin: restored unchecked
    book.refresh(meta.objects, meta.segments)  # a third pinned key: over the bound
    assert book.held_bytes("s0") == 2 * UNIT <= 0.25 * 10 * UNIT
    put(meta, book, [f"k{i}" for i in range(30)], now=1.0)
    assert meta.exists(["a", "b"]) == 2 and meta.exists(["c"]) == 0  # not held: evicted


def test_a_pin_over_the_bound_is_refused_with_409_and_pins_nothing():
    meta, book = pool(fraction=0.25)
    put(meta, book, ["a", "b", "c"])
    with pytest.raises(PoolRequestError) as refused:
        pin(meta, book, ["a", "b", "c"])  # 3 units > 2.5
    assert refused.value.code == 409 and "--max-pinned-fraction" in refused.value.message
    assert book.pins == {} and not book.pinned("a")


def test_absent_keys_are_charged_an_object_of_the_pools_size():
    meta, book = pool(fraction=0.25)
    put(meta, book, ["a"])
    with pytest.raises(PoolRequestError) as refused:
        pin(meta, book, ["x", "y", "z"])  # none present, 3 units expected
    assert refused.value.code == 409


def test_an_expired_pin_holds_nothing_and_its_objects_are_evicted_again():
    meta, book = pool()
    put(meta, book, ["sys0"])
    pin(meta, book, ["sys0"], ttl=10.0)
    assert book.expire(NOW + 9.0) == []
    assert [p.keys for p in book.expire(NOW + 10.0)] == [("sys0",)]
    book.refresh(meta.objects, meta.segments)
    assert not book.pinned("sys0") and book.held_bytes() == 0
    put(meta, book, [f"k{i}" for i in range(30)], now=1.0)
    assert meta.exists(["sys0"]) == 0


def test_an_unpinned_prefix_is_evicted_again():
    meta, book = pool()
    put(meta, book, ["sys0"])
    p = pin(meta, book, ["sys0"])
    assert book.remove(p.pin_id) is p and book.remove(p.pin_id) is None
    book.refresh(meta.objects, meta.segments)
    put(meta, book, [f"k{i}" for i in range(30)], now=1.0)
    assert meta.exists(["sys0"]) == 0


def test_pins_past_max_pins_are_refused_with_409():
    meta, book = pool(units=100)
    for i in range(3):
        pin(meta, book, [f"p{i}"])
    with pytest.raises(PoolRequestError) as refused:
        pin(meta, book, ["p3"])
    assert refused.value.code == 409 and "--max-pins" in refused.value.message


@pytest.mark.parametrize("ttl", [0.0, -1.0, 3600.5])
def test_a_ttl_outside_zero_to_max_pin_ttl_is_refused_with_400(ttl):
    meta, book = pool()
    with pytest.raises(PoolRequestError) as refused:
        pin(meta, book, ["a"], ttl=ttl)
    assert refused.value.code == 400 and "ttl_s" in refused.value.message


def test_bad_or_no_keys_are_refused_with_400():
    meta, book = pool()
    for keys in ([], ["not a key!"]):
        with pytest.raises(PoolRequestError) as refused:
            pin(meta, book, keys)
        assert refused.value.code == 400


def test_pinning_the_same_keys_again_renews_that_pin_instead_of_adding_one():
    meta, book = pool()
    first = pin(meta, book, ["a", "b"], ttl=10.0)
    again = pin(meta, book, ["a", "b"], ttl=100.0, now=NOW + 5)
    assert again is first and len(book.pins) == 1 and first.expires_at == NOW + 105
    assert book.expire(NOW + 20) == []


def test_restored_pins_over_the_bound_hold_the_oldest_first():
    meta, book = pool(fraction=0.25)
    put(meta, book, ["old0", "old1", "new0"])
    old = pin(meta, book, ["old0", "old1"])
    new = Pin("n", ("new0",), NOW + 60, NOW + 1)  # as a new leader reads it back
    book.restore(new)
    book.refresh(meta.objects, meta.segments)
    assert book.describe(old, meta.objects) == (2, 2, 2 * UNIT)
    assert book.describe(new, meta.objects) == (1, 0, 0)


def test_a_store_lost_and_mounted_again_holds_its_pinned_objects_again():
    meta, book = pool()
    put(meta, book, ["sys0"])
    pin(meta, book, ["sys0"])
    meta.unmount("s0")
    book.refresh(meta.objects, meta.segments)
    assert book.held_bytes() == 0
    rec = type("R", (), {"key": "sys0", "offset": 0, "size": UNIT, "checksum": CK, "mac": ""})
    meta.mount("s0", {"region_id": 7, "length": 10 * UNIT}, [rec], now=1.0)
    book.refresh(meta.objects, meta.segments)  # what the service does after a mount
    assert book.held_bytes("s0") == UNIT


@pytest.mark.parametrize("fraction", [-0.1, 0.8, 0.95])
def test_max_pinned_fraction_outside_zero_to_the_low_watermark_is_refused(fraction):
    with pytest.raises(ValueError, match="--max-pinned-fraction"):
        CacheMasterConfig(max_pinned_fraction=fraction).validate()
