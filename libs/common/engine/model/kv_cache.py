"""The paged K/V tensors of one worker: every layer's pages in one buffer.

Layout (one contiguous, registrable buffer):

    buffer[layer, kv, page, slot, kv_head, head_dim]      kv: 0 = K, 1 = V
           L      2   P     page_size

so `key(layer)` / `value(layer)` are contiguous [P, page_size, Hk, D] tensors
and a page's bytes are 2 * L slices of `slice_nbytes` each. Layer-major, because
gathering a batch's pages for attention measured faster this way than page-major
([P, L, 2, ...], one slice per page; docs/engine.md, "KV layout"), and attention
runs every step while transfers move each page once; `page_ranges` gives a
transfer its slices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


class KVCache:
    """Owns the K/V pages; page indices come from the scheduler's allocator.

    Contract: `export_pages(ids)` returns a copy [n, L, 2, page_size, Hk, D];
    `import_pages(ids, data)` writes such a tensor (same shape and dtype) into
    pages `ids`; `page_ranges(ids)` lists (byte offset, length) ranges of the
    buffer that hold pages `ids`, in the same order as `export_pages` flattens.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        allocate: Callable[[int], Any] | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        if allocate is None:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        else:
            # Memory from the transfer engine (e.g. shared memory for the shm transport),
            # so peers can read and write these pages directly.
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            raw = torch.frombuffer(allocate(nbytes), dtype=torch.uint8, count=nbytes)
            self.buffer = raw.view(dtype).view(shape)
            self.buffer.zero_()

    @staticmethod
    def page_nbytes_for(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * elem

    @property
    def slice_nbytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.buffer.element_size()

    @property
    def page_nbytes(self) -> int:
        return 2 * self.num_layers * self.slice_nbytes

    @property
    def dtype_name(self) -> str:
        return str(self.buffer.dtype).removeprefix("torch.")

    def key(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    def _check(self, page_ids: list[int]) -> torch.Tensor:
        for p in page_ids:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is outside the KV pool of {self.num_pages}")
        return torch.tensor(page_ids, dtype=torch.long, device=self.buffer.device)

    def export_pages(self, page_ids: list[int]) -> torch.Tensor:
        idx = self._check(page_ids)
        return self.buffer.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()

    def import_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        idx = self._check(page_ids)
        want = (len(page_ids), self.num_layers, 2, *self.buffer.shape[3:])
        if tuple(data.shape) != want or data.dtype != self.buffer.dtype:
            raise ValueError(
                f"imported KV must be {want} {self.buffer.dtype}, got {tuple(data.shape)} "
                f"{data.dtype}"
            )
        self.buffer.index_copy_(2, idx, data.to(self.buffer.device).permute(1, 2, 0, 3, 4, 5))

    def page_ranges(self, page_ids: list[int]) -> list[tuple[int, int]]:
        """(offset, length) byte ranges of `page_ids`, page by page, layer, K then V."""
        self._check(page_ids)
        s = self.slice_nbytes
        per_kv = self.num_pages * s
        return [
            ((layer * 2 + kv) * per_kv + p * s, s)
            for p in page_ids
            for layer in range(self.num_layers)
            for kv in range(2)
        ]
