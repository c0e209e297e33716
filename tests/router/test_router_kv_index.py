"""The KV index: holders per key from stored/removed/cleared events, prefix matching, bounds."""

import pytest

from libs.common.messages.control import KvEvent
from services.router.routing.kv_index import KvIndex


def ev(source, seq, kind, tier="device", keys=(), parent=""):
    return KvEvent(source=source, seq=seq, kind=kind, tier=tier, keys=list(keys), parent_key=parent)


def test_stored_keys_are_held_by_their_source_and_tier():
    index = KvIndex(100)
    index.apply(ev("w1", 1, "stored", keys=["a", "b"]))
    index.apply(ev("s1", 1, "stored", tier="pool", keys=["a"]))
    assert index.holders("a") == {("w1", "device"), ("s1", "pool")}
    assert index.holders("b") == {("w1", "device")}


def test_removed_key_with_no_holder_left_is_forgotten():
    index = KvIndex(100)
    index.apply(ev("w1", 1, "stored", keys=["a", "b"]))
    index.apply(ev("w1", 2, "removed", keys=["b"]))
    assert index.holders("b") == set() and len(index) == 1


def test_cleared_drops_only_that_source_and_tier():
    index = KvIndex(100)
    index.apply(ev("w1", 1, "stored", keys=["a", "b"]))
    index.apply(ev("w1", 2, "stored", tier="host", keys=["a"]))
    index.apply(ev("w2", 1, "stored", keys=["a"]))
    index.apply(ev("w1", 3, "cleared"))
    assert index.holders("a") == {("w1", "host"), ("w2", "device")}
    assert len(index) == 1


def test_drop_source_forgets_every_tier_of_a_dead_worker():
    index = KvIndex(100)
    index.apply(ev("w1", 1, "stored", keys=["a"]))
    index.apply(ev("w1", 2, "stored", tier="host", keys=["b"]))
    index.drop_source("w1")
    assert len(index) == 0 and index.sources() == set()


def test_index_never_holds_more_than_max_keys_and_evicts_least_recent():
    index = KvIndex(3)
    index.apply(ev("w1", 1, "stored", keys=["a", "b", "c"]))
    index.match(["a"], ["w1"])  # touching "a" makes "b" the least recent
    index.apply(ev("w1", 2, "stored", keys=["d"]))
    assert len(index) == 3 and index.holders("b") == set() and index.holders("a")
    assert index.evicted == 1


def test_match_counts_leading_pages_per_worker_and_pool_coverage():
    index = KvIndex(100)
    keys = ["k0", "k1", "k2", "k3"]
    index.apply(ev("w1", 1, "stored", keys=keys[:2]))
    index.apply(ev("s1", 1, "stored", tier="pool", keys=keys[:3]))
    index.apply(ev("w2", 1, "stored", keys=["k1", "k2"]))  # not a prefix: page 0 missing
    m = index.match(keys, ["w1", "w2", "w3"])
    assert m.pool == 3
    assert m.local == {"w1": 2, "w2": 0, "w3": 0}
    assert m.covered == {"w1": 3, "w2": 3, "w3": 3}


def test_match_stops_at_the_first_page_no_one_holds():
    index = KvIndex(100)
    index.apply(ev("w1", 1, "stored", keys=["k0", "k2"]))
    m = index.match(["k0", "k1", "k2"], ["w1"])
    assert m.local == {"w1": 1} and m.covered == {"w1": 1} and m.pool == 0


def test_seq_gaps_are_counted_and_a_restarted_source_is_not_a_gap():
    index = KvIndex(100)
    index.apply(ev("w1", 1, "stored", keys=["a"]))
    index.apply(ev("w1", 4, "stored", keys=["b"]))
    index.apply(ev("w1", 1, "cleared"))
    assert index.gaps == 2


def test_max_keys_must_be_positive():
    with pytest.raises(ValueError, match="max_keys"):
        KvIndex(0)
