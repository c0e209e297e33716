"""Runs one scheduled step on the model: inputs, forward pass, logits, sampling."""

from __future__ import annotations

import concurrent.futures

import torch

from libs.common.engine.core.scheduler import ScheduledSeq
from libs.common.engine.model.attention import AttentionBackend, AttentionBatch
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.model.sampler import Sampler, SamplerOutput, SamplingRow


class ModelRunner:
    """Turns a list of scheduled chunks into sampled tokens.

    Contract: `run(items, rows)` computes every item's chunk (writing its KV
    into the item's pages) and samples one token for each item whose chunk
    ends its known tokens (`item.sample`); `rows` holds the SamplingRow of
    those items in order; `allowed`, when given, resolves to their grammar masks
    (GrammarMasks.start, computed while the forward pass runs). Returns the sampler's
    output for them, in order.
    """

    def __init__(self, model: LlamaModel, attention: AttentionBackend) -> None:
        self.model = model
        self.attention = attention
        self.sampler = Sampler()
        self.device = attention.kv_cache.buffer.device

    def forward(self, items: list[ScheduledSeq]) -> torch.Tensor:
        """Hidden states of the sampling rows, [n_sampling, hidden]."""
        ids: list[int] = []
        positions: list[int] = []
        q_lens, ctx_lens, tables, keys, last_rows = [], [], [], [], []
        for item in items:
            ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + item.num_tokens))
            q_lens.append(item.num_tokens)
            ctx_lens.append(item.start + item.num_tokens)
            tables.append(item.seq.page_table)
            keys.append(item.seq.uid)
            if item.sample:
                last_rows.append(len(ids) - 1)
        dev = self.device
        plan = self.attention.plan(AttentionBatch(q_lens, ctx_lens, tables, keys))
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.attention,
            plan,
        )
        if len(last_rows) == hidden.shape[0]:
            return hidden
        return hidden.index_select(0, torch.tensor(last_rows, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def run(
        self,
        items: list[ScheduledSeq],
        rows: list[SamplingRow],
        allowed: concurrent.futures.Future[torch.Tensor | None] | None = None,
    ) -> SamplerOutput:
        hidden = self.forward(items)
        if not rows:
            return SamplerOutput([], [])
        logits = self.model.logits(hidden)
        mask = allowed.result() if allowed is not None else None
        return self.sampler(logits.cpu(), rows, mask)
