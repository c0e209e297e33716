"""Moving whole cached pages in and out of a worker's prefix cache, by page key.

What the KV pool (L3) needs from the engine: how much of a prompt is cached here, a copy
of cached pages to write to the pool, and pages read from the pool placed into the cache
so the next admission of that prompt finds them as ordinary cache hits.

Each function takes the EngineCore and must run where the core's other calls run
(`Engine.call`), never during a step. Page data has export_pages' shape:
[n, layers, 2, page_size, kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from libs.common.engine.step_loop import EngineCore


def cached_prefix(core: EngineCore, keys: Sequence[str]) -> int:
    """How many leading `keys` this worker's prefix cache holds (0 with caching off)."""
    cache = core.scheduler.kv.cache
    return len(cache.match(list(keys))) if cache is not None else 0


def export_cached(core: EngineCore, keys: Sequence[str]) -> torch.Tensor | None:
    """A copy of the cached pages of the leading `keys` found (None if none is)."""
    cache = core.scheduler.kv.cache
    if cache is None:
        return None
    pages = cache.match(list(keys))
    if not pages:
        return None
    return core.kv_cache.export_pages(pages)


def import_cached(core: EngineCore, keys: Sequence[str], data: torch.Tensor, start: int = 0) -> int:
    """Place pages for `keys[start:]` (given in `data`) into the cache, under the chain
    `keys[:start]`, which must be cached already. Returns how many leading keys are cached
    afterwards: pages already cached are kept as they are, and with no room even after
    eviction (or a broken chain) fewer, possibly none, are added."""
    kv = core.scheduler.kv
    cache = kv.cache
    keys = list(keys)
    if cache is None or not keys:
        return 0
    if data.shape[0] != len(keys) - start:
        raise ValueError(f"{len(keys) - start} keys to import but {data.shape[0]} pages")
    have = len(cache.match(keys))
    if have < start or have == len(keys):
        return have
    held = keys[:have]
    cache.acquire(held)  # the chain we extend must survive the eviction alloc may do
    try:
        pages = kv.alloc(len(keys) - have)
        if pages is None:
            return have
        core.kv_cache.import_pages(pages, data[have - start :])
        parent = keys[have - 1] if have else None
        cached = cache.insert(keys[have:], pages, parent)
        duplicates = [p for p, c in zip(pages, cached, strict=True) if p != c]
        if duplicates:
            kv.allocator.free(duplicates)
        return len(keys)
    finally:
        cache.release(held)
