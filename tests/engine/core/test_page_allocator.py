"""The KV page free list: whole allocations only, reuse, loud double frees."""

from __future__ import annotations

import pytest

from libs.common.engine.core.page_allocator import PageAllocator


def test_alloc_hands_out_distinct_pages_until_the_pool_is_empty():
    alloc = PageAllocator(8)
    pages = alloc.alloc(3) + alloc.alloc(5)
    assert sorted(pages) == list(range(8))
    assert alloc.num_free == 0 and alloc.num_used == 8


def test_alloc_is_never_partial():
    alloc = PageAllocator(4)
    alloc.alloc(3)
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1


def test_freed_pages_are_reused_first():
    alloc = PageAllocator(16)
    alloc.alloc(4)
    middle = alloc.alloc(4)
    alloc.free(middle)
    assert alloc.alloc(4) == middle


def test_double_free_raises_and_changes_nothing():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)  # pages[0] is free already; pages[1] must stay allocated
    assert alloc.num_free == 3 and not alloc.is_free(pages[1])


def test_freeing_a_page_twice_in_one_call_raises():
    alloc = PageAllocator(4)
    page = alloc.alloc(1)[0]
    with pytest.raises(ValueError, match="double free"):
        alloc.free([page, page])
    assert alloc.num_free == 3


def test_freeing_a_page_outside_the_pool_raises():
    with pytest.raises(ValueError, match="outside"):
        PageAllocator(4).free([4])


def test_a_pool_needs_at_least_one_page():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
