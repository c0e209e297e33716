"""logit_bias, min_tokens and stop_reason in the engine: the sampler adds each bias and
masks the stop tokens below min_tokens; the step loop reports what stopped a request.
Sampler checks on random logits; engine checks with the real default model, greedy."""

from __future__ import annotations

import pytest
import torch

from libs.common.engine.core.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from libs.common.engine.model.sampler import Sampler, SamplingRow

VOCAB = 1000
PROMPT_TEXT = "The capital of France is"


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(3)) * 3


def _greedy(logits, params, **row) -> int:
    return Sampler()(logits, [SamplingRow(params, 0, 0, **row)]).token_ids[0]


def test_a_bias_of_100_makes_greedy_pick_that_token():
    logits = _logits(1)
    target = int(logits.argmin())
    assert _greedy(logits, SamplingParams(temperature=0, logit_bias={str(target): 100})) == target


def test_a_bias_of_minus_100_removes_the_argmax_for_the_runner_up():
    logits = _logits(1)
    best, second = logits[0].topk(2).indices.tolist()
    params = SamplingParams(temperature=0, logit_bias={best: -100})
    assert _greedy(logits, params) == second


def test_the_bias_applies_per_row_and_to_sampled_rows_too():
    logits = _logits(3)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=5, logit_bias={7: 100}),
        SamplingParams(temperature=0, logit_bias={9: 100}),
    ]
    rows = [SamplingRow(p, 5, 0) for p in params]
    out = Sampler()(logits, rows).token_ids
    assert out == [int(logits[0].argmax()), 7, 9]


def test_logprobs_are_of_the_biased_distribution():
    logits = _logits(1)
    target = int(logits.argmin())
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={target: 100})
    lp = Sampler()(logits, [SamplingRow(params, 0, 0)]).logprobs[0]
    assert lp.token_id == target and lp.top[0][0] == target and lp.logprob > -1e-3


def test_suppressed_tokens_are_never_sampled_even_when_biased_up():
    logits = _logits(1)
    best = int(logits.argmax())
    params = SamplingParams(temperature=0, logit_bias={best: 100})
    assert _greedy(logits, params, suppress=(best,)) != best
    for step in range(50):  # random draws as well
        row = SamplingRow(SamplingParams(temperature=2.0), 1, step, suppress=(best,))
        assert Sampler()(logits, [row]).token_ids[0] != best


def test_logit_bias_is_checked_and_normalized_to_sorted_pairs():
    assert SamplingParams(logit_bias={"5": 1, 3: -2.5}).logit_bias == ((3, -2.5), (5, 1.0))
    for bad in ({"x": 1}, {"-1": 1}, {5: 101}, {5: -100.5}, {5: "a"}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    too_many = {i: 1 for i in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=too_many)


def test_min_tokens_may_not_exceed_max_tokens():
    SamplingParams(max_tokens=4, min_tokens=4)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_params_round_trip_with_the_new_fields():
    p = SamplingParams(logit_bias={1: 2}, min_tokens=3)
    assert SamplingParams.from_dict(p.to_dict()) == p


# --- the engine, real model ------------------------------------------------------------


def _run(core, rid, ids, params):
    assert core.add(rid, ids, params) is None
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in core.step() if o.request_id == rid]
    return outs


def _tokens(outs):
    return [t for o in outs for t in o.token_ids]


def test_engine_greedy_output_follows_the_bias(make_core, tokenizer):
    ids = tokenizer.encode(PROMPT_TEXT)
    plain = _tokens(_run(make_core(), "a", ids, SamplingParams(temperature=0, max_tokens=4)))
    banned = SamplingParams(temperature=0, max_tokens=4, logit_bias={plain[0]: -100})
    biased = _tokens(_run(make_core(), "b", ids, banned))
    assert biased[0] != plain[0] and plain[0] not in biased[:1]
    forced = SamplingParams(temperature=0, max_tokens=3, logit_bias={"42": 100})
    assert _tokens(_run(make_core(), "c", ids, forced)) == [42, 42, 42]


def test_engine_refuses_bias_and_stop_ids_outside_the_vocabulary(make_core, tokenizer):
    core, ids = make_core(), tokenizer.encode(PROMPT_TEXT)
    vocab = core.model.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        core.add("x", ids, SamplingParams(logit_bias={vocab: 1}))
    with pytest.raises(ValueError, match="stop_token_ids"):
        core.add("y", ids, SamplingParams(stop_token_ids=[vocab]))


def test_min_tokens_holds_back_eos_and_stop_ids_then_lets_them_end(make_core, tokenizer):
    core, ids = make_core(), tokenizer.encode(PROMPT_TEXT)
    eos = core.model.config.eos_token_ids[0]
    # EOS forced by a bias: without min_tokens it is the first token and ends the request.
    bias = {eos: 100}
    first = _run(core, "a", ids, SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))
    assert _tokens(first) == [eos] and first[-1].finish_reason == "stop"
    assert first[-1].stop_reason is None  # EOS: no stop_reason (vLLM)
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias=bias, min_tokens=3)
    held = _run(core, "b", ids, params)
    assert len(_tokens(held)) == 4 and eos not in _tokens(held)[:3]
    assert _tokens(held)[3] == eos and held[-1].finish_reason == "stop"
    stop_id = 42
    params = SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[stop_id], logit_bias={stop_id: 100},
        min_tokens=2,
    )  # fmt: skip
    out = _run(core, "c", ids, params)
    assert _tokens(out)[2] == stop_id and len(_tokens(out)) == 3
    assert out[-1].stop_reason == stop_id


def test_stop_reason_names_the_stop_string_that_ended_the_text(make_core, tokenizer):
    core, ids = make_core(), tokenizer.encode(PROMPT_TEXT)
    text = "".join(o.text for o in _run(core, "a", ids, SamplingParams(temperature=0,
                                                                        max_tokens=6)))  # fmt: skip
    word = text.split()[0]
    outs = _run(core, "b", ids, SamplingParams(temperature=0, max_tokens=6, stop=["zzz", word]))
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == word
    assert word not in "".join(o.text for o in outs)
    length = _run(core, "c", ids, SamplingParams(temperature=0, max_tokens=2))
    assert length[-1].finish_reason == "length" and length[-1].stop_reason is None


def test_a_migrated_request_keeps_its_bias_and_min_tokens(make_core, tokenizer):
    """The continuation on another worker (`generated`) samples under the same bias and
    counts the generated tokens toward min_tokens: the same tokens as the whole run."""
    from tests.engine.test_continuation import _check_continuations

    eos = make_core().model.config.eos_token_ids[0]
    ids = tokenizer.encode(PROMPT_TEXT)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                            logit_bias={eos: 30, 42: 3})  # fmt: skip
    whole = _tokens(_run(make_core(), "whole", ids, params))
    assert len(whole) == 7 and whole[-1] == eos  # EOS as soon as min_tokens allows it
    _check_continuations(make_core, ids, params, (2, 5))


def test_a_stop_string_is_not_looked_for_before_min_tokens(make_core, tokenizer):
    core, ids = make_core(), tokenizer.encode(PROMPT_TEXT)
    free = _run(core, "a", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    word = free[0].text.strip()  # the first token's text: a stop string at once
    assert word
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[word])
    assert "".join(o.text for o in _run(core, "b", ids, params)).strip() == ""
    held = _run(core, "c", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               stop=[word], min_tokens=3))  # fmt: skip
    text = "".join(o.text for o in held)
    assert text.strip().startswith(word) and len(_tokens(held)) >= 3


def test_a_grammar_that_can_only_end_ends_before_min_tokens():
    """min_tokens suppresses EOS, but a complete grammar allows nothing else: it ends."""
    logits = _logits(2)
    eos = int(logits[0].argmin())
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[0, eos] = True  # row 0: the grammar can only end
    allowed[1, :] = True
    allowed[1, eos] = True
    params = SamplingParams(temperature=0, logit_bias={eos: 100})
    rows = [SamplingRow(params, 0, 0, suppress=(eos,)) for _ in range(2)]
    out = Sampler()(logits, rows, allowed).token_ids
    assert out[0] == eos and out[1] != eos  # row 1 still has other tokens: EOS held back
