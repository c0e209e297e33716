"""Which KV pages each sequence holds: the free list and the prefix cache together."""

from __future__ import annotations

from libs.common.engine.core.kv_hash import PageHasher
from libs.common.engine.core.page_allocator import PageAllocator
from libs.common.engine.core.radix_cache import RadixCache
from libs.common.engine.core.sequence import Sequence


class KvPages:
    """Gives sequences pages, reuses cached prefixes and commits full pages.

    A sequence's `page_table[:num_committed_pages]` are cache pages it holds a
    reference on; the rest are its own, taken from the allocator. Cached pages
    nobody references are evicted (LRU) only when the free list runs short.
    Without a cache (prefix caching off) every page is the sequence's own.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        cache: RadixCache | None = None,
        hasher: PageHasher | None = None,
    ) -> None:
        if (cache is None) != (hasher is None):
            raise ValueError("prefix caching needs both a cache and a hasher")
        for name, part in (("cache", cache), ("hasher", hasher)):
            if part is not None and part.page_size != page_size:
                raise ValueError(f"{name} page_size {part.page_size} != page_size {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.cache = cache
        self.hasher = hasher

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now: free ones plus unreferenced cached ones."""
        evictable = self.cache.num_evictable if self.cache is not None else 0
        return self.allocator.num_free + evictable

    def alloc(self, n: int) -> list[int] | None:
        """n own pages, evicting cached ones if needed; None (and no eviction) if
        even that is not enough."""
        if n > self.num_free_pages:
            return None
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    def match_prefix(self, seq: Sequence) -> tuple[int, int]:
        """Give a sequence holding no pages the longest cached prefix of its
        tokens, minus at least its last token (whose logits must be computed) and
        every position from `seq.logits_from` on. Sets page_table,
        num_committed_pages and num_computed_tokens; returns (pages looked up, pages
        found)."""
        if self.cache is None or seq.page_table:
            return 0, 0
        computed_from = seq.num_tokens - 1
        if seq.logits_from is not None:
            computed_from = min(computed_from, seq.logits_from)
        keys = self.page_keys(seq, computed_from // self.page_size)
        hit = self.cache.match(keys)
        if hit:
            self.cache.acquire(keys[: len(hit)])
            seq.page_table = hit
            seq.num_committed_pages = len(hit)
            seq.num_computed_tokens = len(hit) * self.page_size
        return len(keys), len(hit)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `page_table` hold `num_tokens` tokens; False (nothing taken) if it can't."""
        need = seq.num_new_pages_for(num_tokens, self.page_size)
        if need == 0:
            return True
        pages = self.alloc(need)
        if pages is None:
            return False
        seq.page_table.extend(pages)
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the sequence's own pages past those holding `num_tokens` tokens (the
        positions of rejected drafts); committed pages always stay."""
        keep = max(-(-num_tokens // self.page_size), seq.num_committed_pages)
        if len(seq.page_table) > keep:
            self.allocator.free(seq.page_table[keep:])
            del seq.page_table[keep:]

    def commit(self, seq: Sequence) -> None:
        """Hand the sequence's newly full computed pages to the cache, keeping a
        reference. A page whose key is cached already is swapped for the cached
        copy (same key, same bytes) and freed."""
        if self.cache is None:
            return
        full = seq.num_computed_tokens // self.page_size
        done = seq.num_committed_pages
        if full <= done:
            return
        keys = self.page_keys(seq, full)[done:]
        mine = seq.page_table[done:full]
        parent = seq.page_keys[done - 1] if done else None
        cached = self.cache.insert(keys, mine, parent)
        self.cache.acquire(keys)
        seq.page_table[done:full] = cached
        seq.num_committed_pages = full
        duplicates = [p for p, c in zip(mine, cached, strict=True) if p != c]
        if duplicates:
            self.allocator.free(duplicates)

    def free(self, seq: Sequence) -> None:
        """Return every page: own pages to the allocator, cache references dropped
        (the cached pages stay cached for the next request with that prefix)."""
        done = seq.num_committed_pages
        if done and self.cache is not None:
            self.cache.release(seq.page_keys[:done])
        self.allocator.free(seq.page_table[done:])
        seq.page_table = []
        seq.num_committed_pages = 0

    def page_keys(self, seq: Sequence, n_pages: int) -> list[str]:
        """Keys of the first n_pages full pages, chained from the sequence's cache salt;
        each page is hashed once per sequence."""
        if self.hasher is None:
            raise RuntimeError("page keys need a hasher (prefix caching is off)")
        if len(seq.page_keys) < n_pages:
            tokens = seq.token_ids[: n_pages * self.page_size]
            salt = seq.sampling_params.cache_salt
            seq.page_keys.extend(self.hasher.extend(tokens, seq.page_keys, salt))
        return seq.page_keys[:n_pages]
