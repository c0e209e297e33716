"""Speculative sampling keeps the target's distribution: over many seeds, the tokens a
verified run emits follow the processed distribution at each position (a chi-square test
on a small vocabulary), the draft is accepted with its target probability, and a
rejection emits from the target with the draft removed."""

from __future__ import annotations

import torch

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.model.sampler import Sampler, SamplingRow
from libs.common.engine.spec.verify import accepted_run

VOCAB = 6
SAMPLES = 4000
TEMPERATURE = 0.7
# Chi-square critical value for 5 degrees of freedom at p = 0.001: a correct rule fails
# 1 run in 1,000 per check, with fixed seeds never; a wrong distribution fails at once.
CHI2_5_DF = 20.52


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_verified_runs_follow_the_target_distribution_at_each_position():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, VOCAB, generator=gen)  # position 0, and 1 after the draft
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    draft = int(torch.argsort(probs[0])[-2])  # the second likeliest: rejected often
    params = SamplingParams(max_tokens=8, temperature=TEMPERATURE)
    rows = [SamplingRow(params, seed, step) for seed in range(SAMPLES) for step in (0, 1)]
    tokens = Sampler()(logits.repeat(SAMPLES, 1), rows).token_ids
    runs = [accepted_run([draft], tokens[2 * i : 2 * i + 2]) for i in range(SAMPLES)]

    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=VOCAB).float()
    assert chi2(first, probs[0]) < CHI2_5_DF
    accepted = [r for r in runs if len(r) == 2]
    rate, p = len(accepted) / SAMPLES, float(probs[0, draft])
    assert abs(rate - p) < 4 * (p * (1 - p) / SAMPLES) ** 0.5
    rejected = torch.bincount(
        torch.tensor([r[0] for r in runs if len(r) == 1]), minlength=VOCAB
    ).float()
    assert rejected[draft] == 0
    without = probs[0].clone()
    without[draft] = 0
    assert chi2(rejected, without / without.sum()) < CHI2_5_DF
    second = torch.bincount(torch.tensor([r[1] for r in accepted]), minlength=VOCAB).float()
    assert chi2(second, probs[1]) < CHI2_5_DF


def test_a_wrong_distribution_fails_the_check():
    """The bound can fail: samples of another distribution are refused."""
    probs = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)), -1)
    other = torch.roll(probs, 1)
    counts = torch.multinomial(other, SAMPLES, True, generator=torch.Generator().manual_seed(1))
    assert chi2(torch.bincount(counts, minlength=VOCAB).float(), probs) > CHI2_5_DF
