"""The master's offset allocator: alignment, best fit, coalescing, reuse, fragmentation."""

import itertools
import random

import pytest

from services.cache_master.metadata.allocator import AllocationError, OffsetAllocator


def test_allocations_are_aligned_and_never_overlap():
    alloc = OffsetAllocator(1 << 20, alignment=64)
    rng = random.Random(1)
    spans = []
    for _ in range(200):
        size = rng.randint(1, 5000)
        off = alloc.allocate(size)
        assert off is not None and off % 64 == 0
        spans.append((off, off + size))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_freeing_everything_coalesces_into_one_range():
    alloc = OffsetAllocator(1 << 20)
    rng = random.Random(2)
    offs = [alloc.allocate(rng.randint(1, 9000)) for _ in range(100)]
    rng.shuffle(offs)
    for off in offs:
        alloc.free(off)
    assert alloc.free_ranges == 1 and alloc.largest_free == alloc.capacity
    assert alloc.used_bytes == 0 and len(alloc) == 0


def test_freed_range_is_reused_by_a_request_of_the_same_size():
    alloc = OffsetAllocator(64 * 10)
    offs = [alloc.allocate(64) for _ in range(10)]
    assert alloc.allocate(64) is None
    alloc.free(offs[4])
    assert alloc.allocate(64) == offs[4]


def test_best_fit_keeps_the_large_hole_whole():
    alloc = OffsetAllocator(64 * 100)
    a = alloc.allocate(64 * 2)
    alloc.allocate(64)  # separator
    b = alloc.allocate(64 * 50)
    alloc.allocate(64)  # separator
    alloc.free(a)  # a 2-unit hole
    alloc.free(b)  # a 50-unit hole
    assert alloc.allocate(64) == a  # the small hole, not the big one
    assert alloc.allocate(64 * 50) == b


def test_allocation_fails_only_when_no_contiguous_range_fits():
    alloc = OffsetAllocator(64 * 4)
    offs = [alloc.allocate(64) for _ in range(4)]
    alloc.free(offs[0])
    alloc.free(offs[2])
    assert alloc.free_bytes == 128 and alloc.allocate(128) is None
    alloc.free(offs[1])  # now 0..3 coalesce
    assert alloc.allocate(192) == 0


def test_churn_of_mixed_sizes_leaves_no_leak_and_little_fragmentation():
    alloc = OffsetAllocator(64 << 20, alignment=64)
    rng = random.Random(3)
    live: dict[int, int] = {}
    for _ in range(20000):
        if live and (rng.random() < 0.5 or alloc.free_bytes < (2 << 20)):
            off = rng.choice(list(live))
            alloc.free(off)
            del live[off]
        else:
            size = rng.choice([4096, 4096, 4096, 1 << 20])
            off = alloc.allocate(size)
            if off is not None:
                live[off] = size
    assert alloc.used_bytes == sum(alloc.aligned(s) for s in live.values())
    # Fragmentation bound: the free space is in few ranges relative to the live objects.
    assert alloc.free_ranges <= len(live) + 1
    for off in list(live):
        alloc.free(off)
    assert alloc.free_ranges == 1


def test_allocate_at_claims_exactly_the_given_range_or_refuses():
    alloc = OffsetAllocator(64 * 10)
    alloc.allocate_at(128, 100)  # two units: 128..256
    with pytest.raises(AllocationError):
        alloc.allocate_at(192, 64)  # overlaps
    with pytest.raises(AllocationError):
        alloc.allocate_at(100, 64)  # not aligned
    with pytest.raises(AllocationError):
        alloc.allocate_at(64 * 10, 64)  # past the end
    assert alloc.allocate(128) == 0
    assert alloc.allocate(64) == 256


def test_free_of_an_unknown_offset_is_refused():
    alloc = OffsetAllocator(4096)
    with pytest.raises(AllocationError):
        alloc.free(64)


def test_bad_construction_raises_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="capacity"):
        OffsetAllocator(0)
    with pytest.raises(ValueError, match="alignment"):
        OffsetAllocator(4096, alignment=48)
