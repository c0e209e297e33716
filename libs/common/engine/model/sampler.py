"""Batched, vectorized token sampling over one step's logits.

Per row: penalties -> logit bias (and the stop tokens masked below min_tokens) -> grammar
mask -> (logprobs) -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw.
The draw is Gumbel-max style: argmax(p / E) with E ~ Exp(1) drawn from a generator seeded
by (request seed, output index), so a seeded request samples the same tokens whatever else
is in the batch, after a preemption, and on any worker.
"""

from __future__ import annotations

import dataclasses

import torch

from libs.common.engine.core.outputs import TokenLogprobs
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.model.fused import argmax

_MASK = float("-inf")
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: spreads (seed, step) pairs
_SEED_MASK = (1 << 63) - 1


@dataclasses.dataclass(slots=True)
class SamplingRow:
    """One row of the logits: its params, seed, output index and history.

    `seed` is the request's seed, or one the engine drew for it at arrival;
    `step` is the number of tokens it has generated so far. The token ids are
    only read when a penalty is on. `suppress`: token ids that must not be sampled at this
    step (the stop tokens while the request has fewer than min_tokens).
    """

    params: SamplingParams
    seed: int
    step: int
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    suppress: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class SamplerOutput:
    """One step's sampled tokens and their logprobs, in row order; `prompt_logprobs`
    (set by the model runner) per request id: (prompt token index, its logprobs)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = dataclasses.field(
        default_factory=dict
    )


class Sampler:
    """Samples one token per row; see the module docstring for the order of steps.

    Logprobs are those of the model's distribution after penalties and the grammar mask,
    before temperature and filtering (what vLLM reports by default). `allowed` ([rows,
    vocab] bool, from GrammarMasks) leaves only a grammar's tokens to every sampling mode.
    """

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], allowed: torch.Tensor | None = None
    ) -> SamplerOutput:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        logits = logits.float()
        if any(_has_penalty(r.params) for r in rows):
            logits = _apply_penalties(logits.clone(), rows)
        unbiased = logits
        if any(r.params.logit_bias or r.suppress for r in rows):
            logits = _apply_bias(logits.clone(), rows)
        if allowed is not None:
            logits = _apply_mask(logits, allowed)
            if any(r.suppress for r in rows):
                logits = _grammar_ends_first(logits, unbiased, rows, allowed)
        want_lp = [r.params.logprobs is not None for r in rows]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        tokens = argmax(logits)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, dtype=torch.long)
            picked = _sample(logits.index_select(0, idx), [rows[i] for i in random_rows])
            tokens.index_copy_(0, idx, picked)
        token_ids = tokens.tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(rows)
        if logprobs is not None:
            for i, r in enumerate(rows):
                if r.params.logprobs is not None:
                    out_lp[i] = token_logprobs(logprobs[i], token_ids[i], r.params.logprobs)
        return SamplerOutput(token_ids, out_lp)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _apply_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's logit_bias added to its tokens' logits, its suppressed tokens to -inf
    (in place: `logits` is the sampler's own copy). Ids past the logits' width are
    skipped: the engine refuses them when the request arrives."""
    vocab = logits.shape[1]
    entries: list[tuple[int, int, float]] = []
    for i, r in enumerate(rows):
        entries += [(i, t, bias) for t, bias in r.params.logit_bias if t < vocab]
        entries += [(i, t, _MASK) for t in r.suppress if t < vocab]
    if entries:
        at_row, at_col, add = zip(*entries, strict=True)
        index = (torch.tensor(at_row), torch.tensor(at_col))
        logits.index_put_(index, torch.tensor(add, dtype=logits.dtype), accumulate=True)
    return logits


def _grammar_ends_first(
    logits: torch.Tensor, unbiased: torch.Tensor, rows: list[SamplingRow], allowed: torch.Tensor
) -> torch.Tensor:
    """A row whose grammar allows only the tokens min_tokens suppresses (it can only end)
    samples them anyway: a complete grammar ends the request before min_tokens."""
    for i in torch.isinf(logits).all(dim=1).nonzero().flatten().tolist():
        if rows[i].suppress:
            row = dataclasses.replace(rows[i], suppress=())
            again = _apply_bias(unbiased[i : i + 1].clone(), [row])
            logits[i] = _apply_mask(again, allowed[i : i + 1])[0]
    return logits


def _apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens to -inf (columns past the mask's width too). A row that allows
    nothing (a grammar in error) keeps its logits: the engine ends that request."""
    width = min(allowed.shape[1], logits.shape[1])
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    keep[:, :width] = allowed[:, :width]
    keep |= ~keep.any(dim=1, keepdim=True)
    return logits.masked_fill(~keep, _MASK)


def _counts(ids: list[list[int]], vocab: int) -> torch.Tensor:
    """[B, vocab] occurrence counts of each row's ids (padding goes to a dropped column)."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.full((len(ids), max(width, 1)), vocab, dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            padded[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    counts = torch.zeros(len(ids), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    out_counts = _counts([r.output_ids for r in rows], vocab)
    rep = torch.tensor([r.params.repetition_penalty for r in rows]).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in rows]).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows]).unsqueeze(1)
    if (rep != 1.0).any():
        seen = (_counts([r.prompt_ids for r in rows], vocab) + out_counts) > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    temps = torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([r.params.min_p for r in rows]).unsqueeze(1)
    if (min_p > 0).any():
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    noise = torch.empty_like(probs)
    for i, r in enumerate(rows):
        gen = torch.Generator().manual_seed(((r.seed + 1) * _SEED_MIX + r.step) & _SEED_MASK)
        noise[i].exponential_(generator=gen)
    return argmax(probs / noise)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    values, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k]).unsqueeze(1)
    values = values.masked_fill(ranks >= k, _MASK)
    probs = torch.softmax(values, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the
    # first token always stays.
    above = torch.cumsum(probs, dim=-1) - probs
    p = torch.tensor(top_p).unsqueeze(1)
    values = values.masked_fill(above >= p, _MASK)
    return torch.full_like(logits, _MASK).scatter_(1, order, values)


def token_logprobs(lp: torch.Tensor, token_id: int, n: int, rank: bool = False) -> TokenLogprobs:
    """The alternatives are the top n that can be sampled: a grammar may allow fewer.
    `rank`: also the token's rank among all (1 for the likeliest)."""
    top: list[tuple[int, float]] = []
    if n:
        vals, ids = torch.topk(lp, n)
        top = [(i, v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True) if v > _MASK]
    own = lp[token_id]
    place = int((lp > own).sum()) + 1 if rank else None
    return TokenLogprobs(token_id, float(own), top, place)
