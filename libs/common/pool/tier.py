"""The KV pool as a worker's third tier (L3), under its own prefix cache (L1).

    fetch_prefix(keys)   before a prompt runs: how many leading pages L1 holds; the pool
                         is asked for the rest (one batch_exists), those pages are read
                         into a staging buffer and placed into L1, where the prompt's
                         admission finds them as ordinary cache hits
    write_back(keys)     after pages were computed (prefill) or a sequence ended (decode):
                         pages L1 holds that the pool lacks are copied out and put, off
                         the request's critical path

A page object in the pool is one page in export_pages' layout ([layers, 2, page_size,
kv_heads, head_dim], contiguous), so the object for a key is the same bytes on every
worker. Reads are checksum-verified by the pool client; any failure of the pool costs a
recomputation, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from libs.common.engine.cache_io import cached_prefix, export_cached, import_cached
from libs.common.engine.engine import Engine
from libs.common.log import get_logger
from libs.common.pool.client import LocalMemory, PoolClient
from libs.common.transfer import TransferEngine

log = get_logger(__name__)

RETRY_AFTER_S = 5.0  # a pool (master) that failed is not asked again for this long


class _Staging:
    """A registered buffer of `pages` page objects, used by one operation at a time."""

    def __init__(self, transfer: TransferEngine, pages: int, page_shape, dtype):
        self.pages = pages
        self.page_nbytes = int(torch.Size(page_shape).numel()) * dtype.itemsize
        raw = transfer.allocate(pages * self.page_nbytes)
        self.tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(pages, *page_shape)
        self.memory = LocalMemory.register(transfer, raw)
        self.lock = asyncio.Lock()

    def offsets(self, n: int) -> list[int]:
        return [i * self.page_nbytes for i in range(n)]


class PoolTier:
    """L3 for one worker: reads a prompt's pooled prefix into L1, writes new pages back."""

    def __init__(self, client: PoolClient, engine: Engine, transfer: TransferEngine,
                 staging_pages: int = 16):  # fmt: skip
        if engine.core is None:
            raise ValueError("PoolTier: start the engine first (its KV cache sizes the staging)")
        kv = engine.core.kv_cache
        page_shape = (kv.num_layers, 2, kv.page_size, kv.num_kv_heads, kv.head_dim)
        self.client, self.engine = client, engine
        self._read = _Staging(transfer, staging_pages, page_shape, kv.buffer.dtype)
        self._write = _Staging(transfer, staging_pages, page_shape, kv.buffer.dtype)
        self.pages_read = self.pages_written = 0
        self._down_until = 0.0  # after a failed call, skip the pool for a while

    @property
    def page_nbytes(self) -> int:
        """The bytes of one page object."""
        return self._read.page_nbytes

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        log.warning("pool unavailable; computing instead", op=what, error=str(e),
                    retry_in_s=RETRY_AFTER_S)  # fmt: skip
        self._down_until = time.monotonic() + RETRY_AFTER_S

    async def fetch_prefix(self, keys: Sequence[str]) -> tuple[int, int]:
        """Returns (pages L1 held, pages added to L1 from the pool)."""
        keys = list(keys)
        in_l1 = await self.engine.call(cached_prefix, keys)
        if in_l1 == len(keys) or not self.available:
            return in_l1, 0
        try:
            in_pool = await self.client.batch_exists(keys)
        except Exception as e:  # the pool is a cache: without it, compute
            self._failed("exists", e)
            return in_l1, 0
        have, stage = in_l1, self._read
        async with stage.lock:
            while have < in_pool:
                chunk = keys[have : min(in_pool, have + stage.pages)]
                try:
                    results = await self.client.batch_get(
                        chunk, stage.memory, stage.offsets(len(chunk)), stage.page_nbytes
                    )
                except Exception as e:
                    self._failed("get", e)
                    break
                ok = next((i for i, r in enumerate(results) if not r.ok), len(results))
                if ok == 0:
                    break
                chain = keys[: have + ok]
                placed = await self.engine.call(import_cached, chain, stage.tensor[:ok], have)
                if placed < len(chain):
                    break  # no room in L1: compute the rest
                self.pages_read += ok
                have += ok
                if ok < len(results):
                    break
        return in_l1, have - in_l1

    async def write_back(self, keys: Sequence[str]) -> int:
        """Put the pages of leading `keys` that L1 holds and the pool lacks; returns how many
        were stored. Never raises: the pool is a cache."""
        keys = list(keys)
        if not self.available:
            return 0
        try:
            start = await self.client.batch_exists(keys)
        except Exception as e:
            self._failed("exists", e)
            return 0
        stored, stage = 0, self._write
        async with stage.lock:
            while start < len(keys):
                data = await self.engine.call(export_cached, keys[: start + stage.pages])
                if data is None or data.shape[0] <= start:
                    break  # evicted from L1 meanwhile
                chunk = keys[start : data.shape[0]]
                stage.tensor[: len(chunk)].copy_(data[start:])
                try:
                    results = await self.client.batch_put(
                        chunk, stage.memory, stage.offsets(len(chunk)),
                        [stage.page_nbytes] * len(chunk),
                    )  # fmt: skip
                except Exception as e:
                    self._failed("put", e)
                    break
                stored += sum(r.ok for r in results)
                start += len(chunk)
        self.pages_written += stored
        return stored
