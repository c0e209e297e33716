"""The fused decode layer (one C call per layer) against the op-by-op path: same tokens and
the same log-probabilities, bit for bit, on the default model with native weights."""

from __future__ import annotations

import pytest

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.model.fused_decode import FusedDecode
from tests.engine.conftest import count_fused_runs, run_to_end, run_with_logprobs


def generate(make_core, prompts, **config):
    core = make_core(speculation="off", **config)  # drafted steps are not one-token decodes
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    for i, ids in enumerate(prompts):
        core.add(str(i), ids, params)
    return run_with_logprobs(core)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("streams", [1, 3])
def test_fused_layers_compute_the_same_bits_as_the_op_by_op_path(
    make_core, model_and_tokenizer, tokenizer, monkeypatch, kv_dtype, streams
):
    model, _ = model_and_tokenizer
    assert isinstance(model._fused, FusedDecode), "the default model qualifies"
    texts = ["The quick brown fox", "def fibonacci(n):", "Water boils at"][:streams]
    prompts = [tokenizer.encode(t) for t in texts]
    calls = count_fused_runs(monkeypatch)
    fused = generate(make_core, prompts, kv_dtype=kv_dtype)
    assert sum(used for _, used in calls) >= 20, "most decode steps took the fused path"
    monkeypatch.setattr(model, "_fused", None)
    plain = generate(make_core, prompts, kv_dtype=kv_dtype)
    assert fused == plain


def test_steps_that_do_not_qualify_run_op_by_op(make_core, tokenizer):
    """A prefill, a mirror refill and more rows than GEMV_ROWS all go op by op, and
    generation still completes (the fused path declines rather than fails)."""
    core = make_core()
    ids = [tokenizer.encode(f"Count to {i}:") for i in range(6)]
    for i, prompt in enumerate(ids):
        core.add(str(i), prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    out = run_to_end(core)
    assert sorted(out) == [str(i) for i in range(6)] and all(len(v) == 4 for v in out.values())


def generate_drafting(make_core, prompt, **config):
    """One greedy stream with n-gram drafts: its tokens, their logprobs, and the drafts
    proposed and accepted."""
    core = make_core(speculation="ngram", **config)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3)
    core.add("0", prompt, params)
    tokens, logprobs = run_with_logprobs(core)
    spec = core.speculator
    assert spec is not None
    return tokens["0"], logprobs["0"], (spec.num_proposed, spec.num_accepted)


PROMPTS = {
    "accepted": "one two three four five six seven eight nine ten " * 4 + "one two",
    "rejected": "The cat sat on the mat. The dog sat on the rug. The cat sat on the",
}


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(PROMPTS))
def test_verification_steps_run_fused_with_the_same_bits(
    make_core, model_and_tokenizer, tokenizer, monkeypatch, kv_dtype, kind
):
    """A verification step (1 + k rows of one sequence) runs through the fused layer, and the
    step after it too (the mirror holds the accepted positions, whatever was rejected):
    the same tokens and logprobs as the op-by-op path, and as decoding without drafts."""
    model, _ = model_and_tokenizer
    prompt = tokenizer.encode(PROMPTS[kind])
    calls = count_fused_runs(monkeypatch)
    fused = generate_drafting(make_core, prompt, kv_dtype=kv_dtype)
    steps = list(calls)
    proposed, accepted = fused[2]
    assert any(m > 1 and used for m, used in steps), "verification steps took the fused path"
    # Only the prefill and the first step after it (its mirror slot filled from pages) decline.
    assert sum(not used for _, used in steps) <= 2, steps
    if kind == "accepted":
        assert len(steps) < 20, "most drafts held: fewer steps than tokens"
    else:
        assert accepted < proposed, "some drafts were rejected"
    monkeypatch.setattr(model, "_fused", None)
    assert generate_drafting(make_core, prompt, kv_dtype=kv_dtype) == fused
    plain_tokens, plain_logprobs = generate(make_core, [prompt], kv_dtype=kv_dtype)
    assert fused[0][:24] == plain_tokens["0"]
    assert fused[1][:24] == plain_logprobs["0"], "verified rows score as decode steps do"
