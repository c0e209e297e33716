"""Runs one scheduled step on the model: inputs, forward pass, logits, sampling."""

from __future__ import annotations

import concurrent.futures

import torch

from libs.common.engine.core.batch import ScheduledSeq
from libs.common.engine.core.outputs import TokenLogprobs
from libs.common.engine.model.attention import AttentionBackend, AttentionBatch
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.model.sampler import Sampler, SamplerOutput, SamplingRow, token_logprobs

SCORE_ROWS = 256  # prompt positions scored per logits product (runner._score_prompts)


class ModelRunner:
    """Turns a list of scheduled chunks into sampled tokens.

    Contract: `run(items, rows)` computes every item's chunk (writing its KV
    into the item's pages) and samples one token for each item whose chunk
    ends its known tokens (`item.sample`), and one more for each of its drafts (the
    target's token after each draft, for verification); `rows` holds the SamplingRows
    of those positions in order; `allowed`, when given, resolves to their grammar masks
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
        hidden, last_rows = self._forward(items)
        return self._rows(hidden, last_rows)

    def _forward(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of every computed token, and the rows of the sampling ones."""
        ids: list[int] = []
        positions: list[int] = []
        q_lens, ctx_lens, tables, keys, drafts = [], [], [], [], []
        last_rows: list[int] = []
        for item in items:
            ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + item.num_tokens))
            q_lens.append(item.num_tokens)
            ctx_lens.append(item.start + item.num_tokens)
            tables.append(item.seq.page_table)
            keys.append(item.seq.uid)
            drafts.append(item.num_drafts)
            if item.sample:  # a speculative item samples at each of its positions
                last_rows.extend(range(len(ids) - 1 - item.num_drafts, len(ids)))
        dev = self.device
        plan = self.attention.plan(
            AttentionBatch(q_lens, ctx_lens, tables, keys, drafts if any(drafts) else None)
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.attention,
            plan,
        )
        return hidden, last_rows

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if len(rows) == hidden.shape[0]:
            return hidden
        return hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def run(
        self,
        items: list[ScheduledSeq],
        rows: list[SamplingRow],
        allowed: concurrent.futures.Future[torch.Tensor | None] | None = None,
    ) -> SamplerOutput:
        hidden, last_rows = self._forward(items)
        scored = self._score_prompts(items, hidden)
        if not rows:
            return SamplerOutput([], [], scored)
        logits = self.model.logits(self._rows(hidden, last_rows))
        mask = allowed.result() if allowed is not None else None
        out = self.sampler(logits.cpu(), rows, mask)
        out.prompt_logprobs = scored
        return out

    def _score_prompts(
        self, items: list[ScheduledSeq], hidden: torch.Tensor
    ) -> dict[str, list[tuple[int, TokenLogprobs]]]:
        """Prompt logprobs of this step's chunks: per request, (token index, its logprob
        and top n) for each prompt token after a computed position p >= seq.logits_from
        (the logits at p score token p + 1). Logits go SCORE_ROWS rows at a time: a whole
        2,048-token chunk of a 49k vocabulary would be 400 MB of fp32 at once."""
        # request, hidden row, scored token's index, its id, top n
        wanted: list[tuple[str, int, int, int, int]] = []
        row = 0
        for item in items:
            seq = item.seq
            if seq.logits_from is not None:
                first = max(item.start, seq.logits_from)
                end = min(item.start + item.num_tokens, seq.num_prompt_tokens - 1)
                n = seq.sampling_params.prompt_logprobs or 0
                for p in range(first, end):
                    token = seq.token_ids[p + 1]
                    wanted.append((seq.request_id, row + p - item.start, p + 1, token, n))
            row += item.num_tokens
        out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        for at in range(0, len(wanted), SCORE_ROWS):
            part = wanted[at : at + SCORE_ROWS]
            logits = self.model.logits(self._rows(hidden, [w[1] for w in part]))
            lps = torch.log_softmax(logits.float(), dim=-1).cpu()
            for (rid, _, index, token, n), lp in zip(part, lps, strict=True):
                out.setdefault(rid, []).append((index, token_logprobs(lp, token, n, rank=True)))
        return out
