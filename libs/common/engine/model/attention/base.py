"""The attention backend interface: what the model calls once per layer.

A step's sequences are flattened: rows [0, q_lens[0]) of q belong to sequence 0,
the next q_lens[1] rows to sequence 1, and so on. Sequence i has ctx_lens[i]
tokens of context *including* its q_lens[i] new ones, which sit at positions
ctx_lens[i] - q_lens[i] .. ctx_lens[i] - 1; its K/V live in the pages
page_tables[i] (page j holds positions j*page_size .. (j+1)*page_size - 1).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import torch

from libs.common.engine.model.kv_cache import KVCache


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionBatch:
    """Pure-Python description of one step's attention work (no tensors)."""

    q_lens: list[int]
    ctx_lens: list[int]
    page_tables: list[list[int]]
    # A key per sequence, unique to it for the engine's life (Sequence.uid), so a backend
    # may keep per-sequence state across steps; None: every step stands alone.
    seq_keys: list[int] | None = None
    # Per sequence, how many of its q_lens rows are drafts under verification (the rows
    # after its first: one sequence's consecutive positions); None: no drafts this step.
    num_drafts: list[int] | None = None

    def __post_init__(self) -> None:
        if not len(self.q_lens) == len(self.ctx_lens) == len(self.page_tables):
            raise ValueError("q_lens, ctx_lens and page_tables must have one entry per sequence")
        if self.seq_keys is not None and len(self.seq_keys) != len(self.q_lens):
            raise ValueError("seq_keys must have one entry per sequence")
        if self.num_drafts is not None and len(self.num_drafts) != len(self.q_lens):
            raise ValueError("num_drafts must have one entry per sequence")

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)


class AttentionBackend(abc.ABC):
    """Causal attention over a paged KV cache.

    Contract: `plan(batch)` is called once per step and returns an opaque plan
    shared by every layer; `forward(layer, q [T, Hq, D], k [T, Hk, D],
    v [T, Hk, D], plan)` first stores k and v at the new tokens' slots of
    `layer`, then returns [T, Hq * D]: each row attends to its sequence's
    context up to and including its own position (grouped-query: query head h
    uses KV head h // (Hq / Hk)), scaled by 1/sqrt(D).
    """

    name: str = ""

    def __init__(self, kv_cache: KVCache, num_heads: int) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.num_kv_heads
        self.head_dim = kv_cache.head_dim
        self.scale = kv_cache.head_dim**-0.5

    @abc.abstractmethod
    def plan(self, batch: AttentionBatch) -> Any: ...

    @abc.abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any
    ) -> torch.Tensor: ...


def slot_mapping(batch: AttentionBatch, page_size: int) -> list[int]:
    """Flat cache slot (page * page_size + offset) of every new token, row order."""
    slots: list[int] = []
    for q_len, ctx, pages in zip(batch.q_lens, batch.ctx_lens, batch.page_tables, strict=True):
        if -(-ctx // page_size) > len(pages):
            raise ValueError(f"context of {ctx} tokens needs more than {len(pages)} pages")
        for pos in range(ctx - q_len, ctx):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    return slots
