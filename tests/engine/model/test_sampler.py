"""The batched sampler: greedy, seeds, filters, penalties, logprobs."""

from __future__ import annotations

import torch

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.model.sampler import Sampler, SamplingRow

VOCAB = 1000


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax():
    logits = _logits(4)
    rows = [SamplingRow(SamplingParams(temperature=0), 0, 0) for _ in range(4)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy_at_any_temperature():
    logits = _logits(4)
    rows = [SamplingRow(SamplingParams(temperature=1.5, top_k=1), i, 0) for i in range(4)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_seeded_row_is_reproducible_whatever_else_is_in_the_batch():
    logits = _logits(8)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler()(logits[3:4], [SamplingRow(params, 42, 5)]).token_ids[0]
    others = [SamplingRow(SamplingParams(temperature=0.7, top_p=0.9), i, 1) for i in range(8)]
    others[3] = SamplingRow(params, 42, 5)
    assert Sampler()(logits, others).token_ids[3] == alone


def test_different_steps_draw_different_samples():
    logits = torch.zeros(1, VOCAB)
    draws = {
        Sampler()(logits, [SamplingRow(SamplingParams(seed=1), 1, s)]).token_ids[0]
        for s in range(20)
    }
    assert len(draws) > 10


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for s in range(2000):
        counts[Sampler()(logits, [SamplingRow(SamplingParams(), 7, s)]).token_ids[0]] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[2] / 2000 - 0.1) < 0.03


def test_top_p_and_min_p_keep_only_the_head():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for s in range(200):
        top_p = Sampler()(logits, [SamplingRow(SamplingParams(top_p=0.6), 3, s)]).token_ids[0]
        min_p = Sampler()(logits, [SamplingRow(SamplingParams(min_p=0.5), 3, s)]).token_ids[0]
        assert top_p in (0, 1) and min_p in (0, 1)


def test_penalties_push_seen_tokens_down():
    logits = torch.full((1, 5), 0.5)
    logits[0, 2] = 1.0
    row = SamplingRow(SamplingParams(temperature=0, presence_penalty=2.0), 0, 1, [0], [2])
    assert Sampler()(logits, [row]).token_ids[0] != 2
    rep = SamplingRow(SamplingParams(temperature=0, repetition_penalty=10.0), 0, 1, [2], [])
    assert Sampler()(logits, [rep]).token_ids[0] != 2


def test_logprobs_report_the_sampled_token_and_sorted_top_n():
    logits = _logits(2)
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=3), 0, 0)] * 2
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-5
    assert [i for i, _ in lp.top] == ref.topk(3).indices.tolist()
