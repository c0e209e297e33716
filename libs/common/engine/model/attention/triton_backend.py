"""The triton backend: the Triton paged decode kernel for decode rows, torch for prefill.

CUDA only in production (the interpreter is far too slow to serve); the kernel
itself is unit-tested on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import dataclasses

import torch

from libs.common.engine.model.attention.base import AttentionBackend, AttentionBatch
from libs.common.engine.model.attention.torch_backend import TorchAttention, TorchPlan
from libs.common.engine.model.kv_cache import KVCache


@dataclasses.dataclass(slots=True)
class TritonPlan:
    torch_plan: TorchPlan
    page_table: torch.Tensor | None  # [B, max_pages] int32; None unless decode-only
    ctx_lens: torch.Tensor | None  # [B] int32; None unless decode-only


class TritonAttention(AttentionBackend):
    """See AttentionBackend. Decode-only steps use `paged_decode_attention`; the other
    steps (and every step's base plan) are the torch backend's."""

    name = "triton"

    def __init__(self, kv_cache: KVCache, num_heads: int) -> None:
        super().__init__(kv_cache, num_heads)
        from libs.common.engine.model.attention import triton_decode  # imports triton

        self._paged_decode = triton_decode.paged_decode_attention
        self._torch = TorchAttention(kv_cache, num_heads)

    def plan(self, batch: AttentionBatch) -> TritonPlan:
        base = self._torch.plan(batch)
        if not batch.is_decode_only:
            return TritonPlan(base, None, None)
        dev = self.kv_cache.buffer.device
        width = max(len(t) for t in batch.page_tables)
        table = torch.zeros(len(batch.page_tables), width, dtype=torch.int32)
        for i, pages in enumerate(batch.page_tables):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        ctx = torch.tensor(batch.ctx_lens, dtype=torch.int32)
        return TritonPlan(base, table.to(dev), ctx.to(dev))

    def forward(self, layer, q, k, v, plan: TritonPlan) -> torch.Tensor:
        table, ctx_lens = plan.page_table, plan.ctx_lens
        if table is None or ctx_lens is None:
            return self._torch.forward(layer, q, k, v, plan.torch_plan)
        kc, vc = self.kv_cache.key(layer), self.kv_cache.value(layer)
        hk, d = self.num_kv_heads, self.head_dim
        kc.view(-1, hk, d).index_copy_(0, plan.torch_plan.slots, k)
        vc.view(-1, hk, d).index_copy_(0, plan.torch_plan.slots, v)
        out = self._paged_decode(q.contiguous(), kc, vc, table, ctx_lens, self.scale)
        return out.reshape(q.shape[0], self.num_heads * d)
