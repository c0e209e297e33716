"""The prefix cache: longest match, duplicates, references, LRU leaf eviction, events."""

from __future__ import annotations

import pytest

from libs.common.engine.core.radix_cache import CacheEvent, RadixCache


def k(*names: str) -> list[str]:
    """Readable stand-ins for page keys; the cache only needs them to be distinct."""
    return list(names)


def test_match_returns_the_pages_of_the_longest_cached_prefix():
    cache = RadixCache(page_size=4)
    cache.insert(k("a", "b", "c"), [10, 11, 12])
    assert cache.match(k("a", "b", "x", "c")) == [10, 11]
    assert cache.match(k("b")) == []


def test_insert_returns_the_cached_page_for_keys_already_present():
    cache = RadixCache(page_size=4)
    cache.insert(k("a", "b"), [1, 2])
    assert cache.insert(k("a", "b", "c"), [7, 8, 9]) == [1, 2, 9]
    assert len(cache) == 3


def test_insert_under_a_parent_extends_that_chain():
    cache = RadixCache(page_size=4)
    cache.insert(k("a"), [1])
    cache.insert(k("b"), [2], parent="a")
    assert cache.match(k("a", "b")) == [1, 2]


def test_a_page_cannot_be_cached_under_two_keys():
    cache = RadixCache(page_size=4)
    cache.insert(k("a"), [1])
    with pytest.raises(ValueError, match="page 1"):
        cache.insert(k("x", "y"), [5, 1])
    assert "x" not in cache  # a refused insert changes nothing


def test_evict_takes_the_least_recently_used_leaf_first():
    cache = RadixCache(page_size=4)
    cache.insert(k("a"), [1])
    cache.insert(k("b"), [2])
    cache.match(k("a"))
    assert cache.evict(1) == [2]


def test_evict_never_takes_a_referenced_node():
    cache = RadixCache(page_size=4)
    cache.insert(k("a", "b"), [1, 2])
    cache.insert(k("c"), [3])
    cache.acquire(k("a", "b"))
    assert cache.evict(10) == [3]
    assert cache.match(k("a", "b")) == [1, 2]
    cache.release(k("a", "b"))
    assert sorted(cache.evict(10)) == [1, 2]


def test_evict_takes_children_before_their_parents():
    cache = RadixCache(page_size=4)
    cache.insert(k("a", "b", "c"), [1, 2, 3])
    cache.insert(k("z"), [9])
    cache.match(k("z"))  # z is newer, yet a and b may only go after c
    assert cache.evict(3) == [3, 2, 1]


def test_release_without_acquire_raises():
    cache = RadixCache(page_size=4)
    cache.insert(k("a"), [1])
    with pytest.raises(ValueError, match="released"):
        cache.release(k("a"))


def test_num_evictable_counts_unreferenced_pages():
    cache = RadixCache(page_size=4)
    cache.insert(k("a", "b", "c"), [1, 2, 3])
    cache.acquire(k("a"))
    cache.acquire(k("a"))
    assert cache.num_evictable == 2
    cache.release(k("a"))
    assert cache.num_evictable == 2
    cache.release(k("a"))
    assert cache.num_evictable == 3


def test_every_change_is_reported_as_an_event():
    events: list[CacheEvent] = []
    cache = RadixCache(page_size=4, on_event=events.append)
    cache.insert(k("a", "b"), [1, 2])
    cache.insert(k("a", "b", "c"), [5, 6, 3])
    cache.evict(1)
    cache.reset()
    assert [(e.kind, e.keys, e.parent_key, e.num_tokens) for e in events] == [
        ("stored", ("a", "b"), None, 8),
        ("stored", ("c",), "b", 4),
        ("removed", ("c",), None, 4),
        ("cleared", (), None, 0),
    ]
    assert {e.tier for e in events} == {"L1"}


def test_reset_refuses_while_pages_are_referenced():
    cache = RadixCache(page_size=4)
    cache.insert(k("a"), [1])
    cache.acquire(k("a"))
    with pytest.raises(RuntimeError, match="referenced"):
        cache.reset()


def test_repeated_hits_keep_the_eviction_queue_bounded():
    cache = RadixCache(page_size=4)
    cache.insert(k("a", "b"), [1, 2])
    for _ in range(10_000):
        cache.match(k("a", "b"))
    assert len(cache._heap) <= 2 * len(cache) + 64
    assert cache.evict(2) == [2, 1]


def test_stats_count_queries_and_hit_pages():
    cache = RadixCache(page_size=4)
    cache.stats.record(query_pages=4, hit_pages=3)
    cache.stats.record(query_pages=4, hit_pages=0)
    assert (cache.stats.queries, cache.stats.hits) == (2, 1)
    assert cache.stats.page_hit_rate == 3 / 8
