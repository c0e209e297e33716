"""The flashinfer backend (CUDA): batch prefill / decode wrappers over the paged cache.

KVCache's per-layer K and V are [num_pages, page_size, kv_heads, head_dim],
flashinfer's "NHD" paged layout, so they are passed as they are. The index
arrays are int32, and causal=True is set explicitly (it is not flashinfer's
default). One plan per step serves every layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from libs.common.engine.model.attention.base import AttentionBackend, AttentionBatch, slot_mapping

_WORKSPACE_BYTES = 128 * 2**20


@dataclasses.dataclass(slots=True)
class FlashInferPlan:
    slots: torch.Tensor
    wrapper: Any  # the planned prefill or decode wrapper


class FlashInferAttention(AttentionBackend):
    """See AttentionBackend. Needs a CUDA KV cache and the flashinfer package."""

    name = "flashinfer"

    def __init__(self, kv_cache, num_heads: int) -> None:
        super().__init__(kv_cache, num_heads)
        if kv_cache.buffer.device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs device 'cuda'")
        import flashinfer  # CUDA only: never imported on a CPU machine

        dev = kv_cache.buffer.device
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")

    def plan(self, batch: AttentionBatch) -> FlashInferPlan:
        dev = self.kv_cache.buffer.device
        ps = self.kv_cache.page_size
        qo_indptr, kv_indptr, indices, last_len = [0], [0], [], []
        for q_len, ctx, pages in zip(batch.q_lens, batch.ctx_lens, batch.page_tables, strict=True):
            n = -(-ctx // ps)
            indices.extend(pages[:n])
            qo_indptr.append(qo_indptr[-1] + q_len)
            kv_indptr.append(kv_indptr[-1] + n)
            last_len.append(ctx - (n - 1) * ps)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        dtype = self.kv_cache.buffer.dtype
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, ps)
        if batch.is_decode_only:
            self._decode.plan(i32(kv_indptr), i32(indices), i32(last_len), *shape,
                              q_data_type=dtype, kv_data_type=dtype)  # fmt: skip
            wrapper = self._decode
        else:
            self._prefill.plan(i32(qo_indptr), i32(kv_indptr), i32(indices), i32(last_len),
                               *shape, causal=True, q_data_type=dtype,
                               kv_data_type=dtype)  # fmt: skip
            wrapper = self._prefill
        slots = torch.tensor(slot_mapping(batch, ps), dtype=torch.long, device=dev)
        return FlashInferPlan(slots, wrapper)

    def forward(self, layer, q, k, v, plan: FlashInferPlan) -> torch.Tensor:
        kc, vc = self.kv_cache.key(layer), self.kv_cache.value(layer)
        hk, d = self.num_kv_heads, self.head_dim
        kc.view(-1, hk, d).index_copy_(0, plan.slots, k)
        vc.view(-1, hk, d).index_copy_(0, plan.slots, v)
        out = plan.wrapper.run(q.contiguous(), (kc, vc))
        return out.reshape(q.shape[0], self.num_heads * d)
