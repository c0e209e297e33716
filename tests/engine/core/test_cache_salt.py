"""cache_salt at the engine: the salt roots the chain of page keys, so a prefix cached
under one salt is never matched under another (or under none), and no salt keeps the
keys every cache already holds."""

from __future__ import annotations

import struct

import pytest
import xxhash

from libs.common.engine.core.kv_hash import PageHasher, chain_root
from libs.common.engine.core.page_allocator import PageAllocator
from libs.common.engine.core.radix_cache import RadixCache
from libs.common.engine.core.sampling_params import (
    MAX_CACHE_SALT_CHARS,
    SamplingParams,
)
from libs.common.engine.core.scheduler import Scheduler
from libs.common.engine.core.sequence import Sequence
from libs.common.messages.control import GenerateRequest, SamplingSpec

PAGE = 4
TOKENS = [(i * 7919) % 50_000 for i in range(64)]


def hasher(page_size: int = 16) -> PageHasher:
    return PageHasher("smollm2-135m", "float32", page_size)


def test_no_salt_keeps_the_unsalted_keys_and_their_pinned_value():
    page = list(range(16))
    assert hasher().keys(page, cache_salt="") == hasher().keys(page)
    assert hasher().keys(page) == ["b90ccd06d740a30e22aaab6128560d25"]
    assert chain_root("") == bytes(16)


def test_a_salted_first_key_chains_from_the_salts_root():
    page = list(range(16))
    root = xxhash.xxh3_128_digest(b"tandem-cache-salt\0tenant-a")
    salt = b"tandem-kv-v1\0smollm2-135m\0float32\x0016\0"
    by_hand = xxhash.xxh3_128_hexdigest(root + salt + struct.pack("<16i", *page))
    assert hasher().keys(page, cache_salt="tenant-a") == [by_hand]


@pytest.mark.parametrize("other", ["", "tenant-b", "tenant-a ", "Tenant-a"])
def test_another_salt_shares_no_key_with_salt_a(other: str):
    mine = hasher().keys(TOKENS, cache_salt="tenant-a")
    theirs = hasher().keys(TOKENS, cache_salt=other)
    assert len(mine) == 4 and not set(mine) & set(theirs)


def test_the_same_salt_gives_the_same_keys_at_once_or_page_by_page():
    h = hasher(page_size=PAGE)
    known: list[str] = []
    for end in [*range(0, len(TOKENS), 3), len(TOKENS)]:
        known += h.extend(TOKENS[:end], known, cache_salt="tenant-a")
    assert known == h.keys(TOKENS, cache_salt="tenant-a")
    # A parent key already carries the salt: chaining after it ignores the argument.
    assert h.keys(TOKENS[8:16], parent=known[1], cache_salt="x") == known[2:4]
    assert h.page_key(None, TOKENS[:PAGE], "tenant-a") == known[0]


def make() -> Scheduler:
    return Scheduler(
        PageAllocator(64),
        page_size=PAGE,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        cache=RadixCache(PAGE),
        hasher=PageHasher("test-model", "float32", PAGE),
        eos_token_ids=[2],
    )


def run(s: Scheduler, rid: str, salt: str) -> Sequence:
    """One request of 13 prompt tokens (3 full pages), run to its end; returns it."""
    seq = Sequence(rid, list(range(100, 113)), SamplingParams(max_tokens=1, cache_salt=salt))
    s.add(seq)
    for _ in range(100):
        if not s.has_work():
            return seq
        out = s.schedule()
        s.postprocess(out, {x.seq.request_id: 7 for x in out.scheduled if x.sample})
    raise AssertionError("scheduler did not drain")


def test_the_radix_cache_serves_a_prefix_only_to_requests_with_its_salt():
    s = make()
    assert run(s, "a1", "tenant-a").num_cached_tokens == 0
    assert run(s, "b1", "tenant-b").num_cached_tokens == 0
    assert run(s, "none", "").num_cached_tokens == 0
    assert run(s, "a2", "tenant-a").num_cached_tokens == 12
    assert run(s, "b2", "tenant-b").num_cached_tokens == 12


def test_a_decode_reservation_reuses_only_its_own_salts_pages():
    s = make()
    run(s, "a1", "tenant-a")
    tokens = list(range(100, 113))
    other = Sequence("b", tokens, SamplingParams(cache_salt="tenant-b"), keep_pages=True)
    assert s.reserve(other, reuse_prefix=True) is not None
    assert other.num_committed_pages == 0
    same = Sequence("a", tokens, SamplingParams(cache_salt="tenant-a"), keep_pages=True)
    assert s.reserve(same, reuse_prefix=True) is not None
    assert same.num_committed_pages == 3


@pytest.mark.parametrize("value", [7, None, "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_salt_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=value)


def test_the_salt_travels_in_the_wire_sampling_and_back():
    spec = SamplingSpec(**SamplingParams(cache_salt="tenant-\u00e9").to_dict())
    req = GenerateRequest(request_id="r", token_ids=[1, 2], sampling=spec, stream_subject="s")
    back = GenerateRequest.decode(req.encode())
    assert back.sampling.cache_salt == "tenant-\u00e9"
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingSpec(cache_salt="x" * (MAX_CACHE_SALT_CHARS + 1))
