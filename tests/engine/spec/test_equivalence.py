"""Speculative decoding on the default model gives what decoding without it gives: the
same tokens, text, logprobs, finish and usage, for prompts whose drafts are accepted and
ones whose drafts are rejected, with stop strings, max_tokens inside a draft, penalties,
seeded sampling and a JSON-schema grammar; and the prefix cache it fills serves right KV."""

from __future__ import annotations

import pytest

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.model.fused_decode import FusedDecode
from libs.common.grammar import build
from tests.engine.test_grammar import PERSON

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the "
    "children were playing near the old oak tree while their parents talked about the weather."
)
REPEAT = f"Repeat this paragraph exactly.\n\n{PARAGRAPH}\n\nRepeated paragraph:\n"
PERSON_JSON = '{"name": "Ada", "age": 36, "pets": ["cat", "dog"]}'


def generate(make_core, requests: dict[str, tuple[list[int], SamplingParams]], **config):
    """Each request to its end, one after the other (a lone stream drafts the most), or
    all in one batch with `batch=True`: per request its outputs merged."""
    batch = config.pop("batch", False)
    core = make_core(**config)
    got: dict[str, dict] = {r: {"tokens": [], "text": "", "lps": []} for r in requests}
    for rid, (ids, params) in requests.items():
        core.add(rid, ids, params)
        if not batch:
            _drain(core, got)
    _drain(core, got)
    return got, core


def _drain(core, got: dict[str, dict]) -> None:
    while core.has_work():
        for out in core.step():
            g = got[out.request_id]
            g["tokens"] += out.token_ids
            g["text"] += out.text
            g["lps"] += [(lp.token_id, lp.logprob, [t for t, _ in lp.top]) for lp in out.logprobs]
            if out.finished:
                g["end"] = (out.finish_reason, out.stop_reason, out.num_output_tokens)


def assert_same(plain: dict, spec: dict) -> None:
    for rid, want in plain.items():
        have = spec[rid]
        assert have["tokens"] == want["tokens"], rid
        assert (have["text"], have["end"]) == (want["text"], want["end"]), rid
        assert len(have["lps"]) == len(want["lps"]), rid
        for (t1, v1, top1), (t2, v2, top2) in zip(have["lps"], want["lps"], strict=True):
            assert (t1, top1) == (t2, top2) and v1 == pytest.approx(v2, abs=2e-3), rid


def test_greedy_and_seeded_outputs_equal_decoding_without_speculation(make_core, tokenizer):
    repeat, free = tokenizer.encode(REPEAT), tokenizer.encode("Water boils at")
    greedy = {"temperature": 0.0}
    requests = {
        "accepted": (repeat, SamplingParams(max_tokens=40, logprobs=2, **greedy)),
        "rejected": (free, SamplingParams(max_tokens=24, ignore_eos=True, **greedy)),
        "stop": (repeat, SamplingParams(max_tokens=60, stop=("oak tree",), **greedy)),
        "length": (repeat, SamplingParams(max_tokens=13, **greedy)),
        "penalty": (repeat, SamplingParams(max_tokens=24, repetition_penalty=1.3, **greedy)),
        "seeded": (repeat, SamplingParams(max_tokens=24, temperature=0.8, seed=3)),
    }
    plain, _ = generate(make_core, requests, speculation="off")
    spec, core = generate(make_core, requests)
    assert_same(plain, spec)
    assert plain["stop"]["end"][0] == "stop" and plain["length"]["end"] == ("length", None, 13)
    s = core.speculator
    assert 0 < s.num_accepted < s.num_proposed, "drafts were both accepted and rejected"
    # the lone-sequence steps were timed by draft length for the policy (StepCosts)
    steps = s.costs.stats()["steps"]
    assert steps[0] > 0 and sum(steps[1:]) > 0, steps


def test_greedy_json_schema_output_equals_decoding_without_speculation(make_core, tokenizer):
    prompt = tokenizer.encode(f"Copy this JSON object exactly.\n{PERSON_JSON}\nCopy:\n")
    params = SamplingParams(max_tokens=48, temperature=0.0, grammar=build.json_schema(PERSON))
    plain, _ = generate(make_core, {"json": (prompt, params)}, speculation="off")
    spec, core = generate(make_core, {"json": (prompt, params)})
    assert_same(plain, spec)
    assert spec["json"]["end"][0] == "stop"
    assert core.speculator.num_accepted > 0


def test_prefix_cache_filled_while_speculating_serves_the_right_kv(make_core, tokenizer):
    """A second request whose prompt is the first one's prompt and output reuses the pages
    written during speculative decoding, and continues as a cold engine does."""
    first = tokenizer.encode(REPEAT)
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    spec, core = generate(make_core, {"a": (first, greedy)})
    assert core.speculator.num_accepted > 0
    second = first + spec["a"]["tokens"]
    core.add("b", second, SamplingParams(max_tokens=16, temperature=0.0))
    warm: list[int] = []
    cached = 0
    while core.has_work():
        for out in core.step():
            warm += out.token_ids
            cached = out.num_cached_tokens
    assert cached > len(first), "pages computed while speculating were reused"
    cold, _ = generate(
        make_core, {"b": (second, SamplingParams(max_tokens=16, temperature=0.0))},
        speculation="off", enable_prefix_cache=False,
    )  # fmt: skip
    assert warm == cold["b"]["tokens"]


def test_two_streams_draft_together_with_the_outputs_of_plain_decoding(make_core, tokenizer):
    """Two running sequences draft one token each in the same step (the fused layer's
    rows shared); their outputs equal decoding without speculation."""
    other = f"Repeat this sentence exactly.\n\n{PERSON_JSON} is a JSON object.\n\nRepeated:\n"
    requests = {
        "a": (tokenizer.encode(REPEAT), SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)),
        "b": (tokenizer.encode(other), SamplingParams(max_tokens=40, temperature=0.0)),
    }
    plain, _ = generate(make_core, requests, speculation="off", batch=True)
    core = make_core()
    together: list[list[int]] = []  # each step's draft lengths while two sequences run
    real = core.speculator.draft

    def draft(running):
        real(running)
        if len(running) == 2:
            together.append([len(s.draft_ids) for s in running])

    core.speculator.draft = draft
    got: dict[str, dict] = {r: {"tokens": [], "text": "", "lps": []} for r in requests}
    for rid, (ids, params) in requests.items():
        core.add(rid, ids, params)
    _drain(core, got)
    assert_same(plain, got)
    assert any(sum(lengths) == 2 for lengths in together), "both drafted in one step"
    assert all(max(lengths) <= 1 for lengths in together), together
    assert core.speculator.num_accepted > 0


def test_three_streams_draft_nothing_and_a_lone_stream_still_runs_fused(
    make_core, tokenizer, monkeypatch
):
    repeat = tokenizer.encode(REPEAT)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    _, core = generate(make_core, {str(i): (repeat, params) for i in range(3)}, batch=True)
    assert core.speculator.num_proposed == 0
    calls: list[bool] = []
    real_run = FusedDecode.run

    def counting_run(self, *args):
        calls.append(real_run(self, *args))
        return calls[-1]

    monkeypatch.setattr(FusedDecode, "run", counting_run)
    free = tokenizer.encode("def fibonacci(n):")
    generate(make_core, {"f": (free, SamplingParams(max_tokens=32, ignore_eos=True))})
    assert any(calls), "steps without drafts take the fused decode path"
