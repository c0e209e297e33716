"""Prompt logprobs (SamplingParams.prompt_logprobs): exact, and cheap on a cached prefix.

The first output of a request carries the logprob of each prompt token from
max(prompt_logprobs_from, 1) on. They are the model's: within the last-position logits'
bound of transformers on the same GGUF, and equal whether the prefix before the scored part
came from the cache or was computed, in one chunk or several.
"""

from __future__ import annotations

import math

import pytest
import torch

from libs.common.engine.core.sampling_params import SamplingParams
from tests.engine.conftest import run_to_end

PROMPT = (
    "You are a careful assistant. Answer with one word.\n"
    "Question: which planet is known as the red planet?\nAnswer: Mars"
)


def scored(core, rid: str, ids: list[int], **params) -> tuple[list, object]:
    """The prompt logprobs of one request run alone, and its first output."""
    core.add(rid, ids, SamplingParams(max_tokens=1, temperature=0, **params))
    first = None
    while core.has_work():
        for out in core.step():
            if out.request_id == rid and out.token_ids and first is None:
                first = out
    return first.prompt_logprobs, first


def test_every_prompt_token_after_the_first_is_scored_with_its_own_id(make_core, tokenizer):
    ids = tokenizer.encode(PROMPT)
    lps, first = scored(make_core(), "a", ids, prompt_logprobs=2)
    assert [lp.token_id for lp in lps] == ids[1:]
    assert all(lp.logprob <= 0 and math.isfinite(lp.logprob) for lp in lps)
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] for lp in lps)
    # a token that is its position's top choice has the top's logprob
    for lp in lps:
        if lp.top[0][0] == lp.token_id:
            assert lp.logprob == pytest.approx(lp.top[0][1], abs=1e-6)
    assert first.num_cached_tokens == 0


@pytest.mark.slow
def test_prompt_logprobs_within_1e3_of_reference_log_softmax(make_core, tokenizer, reference_model):
    ids = tokenizer.encode(PROMPT)
    lps, _ = scored(make_core(), "a", ids, prompt_logprobs=0)
    with torch.no_grad():
        logits = reference_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    got = [lp.logprob for lp in lps]
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < 1e-2, f"largest difference {worst:.2e} (logprobs, nats)"


def test_a_cached_prefix_is_reused_up_to_the_scored_part_only_and_scores_equal(
    make_core, tokenizer
):
    core = make_core(page_size=16)
    ids = tokenizer.encode(PROMPT + " " + PROMPT)
    full, _ = scored(core, "warm", ids, prompt_logprobs=0)  # computes and caches every page
    start = 37
    part, first = scored(core, "again", ids, prompt_logprobs=0, prompt_logprobs_from=start)
    # The cache stops at the page holding position start - 1 (its logits score token start).
    assert first.num_cached_tokens == (start - 1) // 16 * 16
    assert [lp.token_id for lp in part] == ids[start:]
    for a, b in zip(part, full[start - 1 :], strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_chunked_prefill_scores_equal_one_chunk(make_core, tokenizer):
    ids = tokenizer.encode(PROMPT * 3)
    whole, _ = scored(make_core(enable_prefix_cache=False), "a", ids, prompt_logprobs=1)
    chunked, _ = scored(
        make_core(enable_prefix_cache=False, max_num_batched_tokens=40, max_num_seqs=4),
        "b",
        ids,
        prompt_logprobs=1,
    )
    assert len(whole) == len(chunked) == len(ids) - 1
    # Attention over a chunk's cached KV sums in another order: fp32 rounding only.
    for a, b in zip(whole, chunked, strict=True):
        assert (a.token_id, a.top[0][0]) == (b.token_id, b.top[0][0])
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)


def test_scoring_from_the_end_of_the_prompt_gives_none_and_the_same_first_token(
    make_core, tokenizer
):
    ids = tokenizer.encode(PROMPT)
    core = make_core()
    lps, first = scored(core, "a", ids, prompt_logprobs=0, prompt_logprobs_from=len(ids))
    plain = {}
    core.add("b", ids, SamplingParams(max_tokens=1, temperature=0))
    plain = run_to_end(core)
    assert lps == []
    assert first.token_ids == plain["b"]


def test_a_request_without_prompt_logprobs_in_the_same_batch_gets_none(make_core, tokenizer):
    core = make_core()
    ids = tokenizer.encode(PROMPT)
    core.add("plain", ids[:20], SamplingParams(max_tokens=2, temperature=0))
    core.add("scored", ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    firsts: dict[str, list] = {}
    while core.has_work():
        for out in core.step():
            if out.token_ids:
                firsts.setdefault(out.request_id, []).append(out.prompt_logprobs)
    assert firsts["plain"] == [[], []]
    assert len(firsts["scored"][0]) == len(ids) - 1 and firsts["scored"][1] == []
