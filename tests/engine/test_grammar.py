"""Grammar-constrained decoding in the engine (llguidance), with the real default model.

Sampling is at temperature 1 with seeds: only an enforced grammar makes the outputs valid.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.sequence import pages_for
from libs.common.grammar import build
from libs.common.grammar.build import GrammarError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _run(core) -> tuple[dict[str, str], dict[str, str], dict[str, list]]:
    text: dict[str, str] = {}
    reason: dict[str, str] = {}
    lps: dict[str, list] = {}
    while core.has_work():
        for out in core.step():
            text[out.request_id] = text.get(out.request_id, "") + out.text
            lps.setdefault(out.request_id, []).extend(out.logprobs)
            if out.finished:
                reason[out.request_id] = out.finish_reason
    return text, reason, lps


def test_sampled_json_follows_its_schema_in_a_batch_at_temperature_1(make_core, tokenizer):
    core = make_core()
    prompt = _chat(tokenizer, "Describe a person as JSON.")
    grammar = build.json_schema(PERSON)
    for seed in range(8):
        params = SamplingParams(max_tokens=96, temperature=1.0, seed=seed, grammar=grammar)
        core.add(f"r{seed}", prompt, params)
    core.add("free", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    text, reason, _ = _run(core)
    for seed in range(8):
        assert reason[f"r{seed}"] == "stop", text[f"r{seed}"]
        jsonschema.validate(json.loads(text[f"r{seed}"]), PERSON)


def test_a_regex_is_fully_matched_and_ends_the_request(make_core, tokenizer):
    core = make_core()
    pattern = r"(yes|no), because [a-z ]{5,30}\."
    prompt = _chat(tokenizer, "Is the sky blue?")
    for seed in range(4):
        params = SamplingParams(
            max_tokens=64, temperature=1.0, seed=seed, grammar=build.regex(pattern)
        )
        core.add(f"r{seed}", prompt, params)
    text, reason, _ = _run(core)
    for seed in range(4):
        assert reason[f"r{seed}"] == "stop"
        assert re.fullmatch(pattern, text[f"r{seed}"]), text[f"r{seed}"]


def test_logprobs_are_those_of_the_constrained_distribution(make_core, tokenizer):
    core = make_core()
    grammar = build.ebnf('root ::= "red" | "green" | "blue"')
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, grammar=grammar, logprobs=20)
    core.add("r", _chat(tokenizer, "Name a colour."), params)
    text, _, lps = _run(core)
    assert text["r"] in ("red", "green", "blue")
    first = lps["r"][0]
    words = ("red", "green", "blue")
    pieces = [tokenizer.decode([t]) for t, _ in first.top]
    assert pieces and all(any(w.startswith(p) for w in words) for p in pieces), pieces
    # Every token the grammar allows is among the alternatives: they hold all the mass.
    assert math.isclose(sum(math.exp(lp) for _, lp in first.top), 1.0, rel_tol=1e-4)


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length(make_core, tokenizer):
    core = make_core()
    params = SamplingParams(
        max_tokens=4, temperature=1.0, seed=0, grammar=build.json_schema(PERSON)
    )
    core.add("r", _chat(tokenizer, "Describe a person as JSON."), params)
    _, reason, _ = _run(core)
    assert reason["r"] == "length"


def test_a_grammar_that_does_not_compile_is_refused_at_add(make_core, tokenizer):
    core = make_core()
    params = SamplingParams(max_tokens=4, grammar=build.json_schema({"type": "foo"}))
    with pytest.raises(GrammarError):
        core.add("r", _chat(tokenizer, "hi"), params)
    assert not core.has_work()


def test_a_constrained_request_on_a_cached_prefix_equals_the_cold_one(make_core, tokenizer):
    core = make_core()
    prompt = _chat(tokenizer, "Describe a person as JSON. " * 8)
    params = SamplingParams(max_tokens=64, temperature=0, grammar=build.json_schema(PERSON))
    core.add("cold", prompt, params)
    cold, _, _ = _run(core)
    core.add("warm", prompt, params)
    warm, _, _ = _run(core)
    assert core.scheduler.get("warm") is None
    assert warm["warm"] == cold["cold"]
    jsonschema.validate(json.loads(cold["cold"]), PERSON)


async def _texts(stream) -> tuple[list[int], str, str | None]:
    ids, text, reason = [], "", None
    async for out in stream:
        ids += out.token_ids
        text += out.text
        reason = out.finish_reason if out.finished else reason
    return ids, text, reason


async def test_disaggregated_decode_replays_token_0_and_equals_one_engine(make_engine, tokenizer):
    """The prefill engine samples token 0 under the grammar; the decode engine's matcher
    starts after it (replayed, not sampled again): same tokens as one engine, seeded."""
    prompt = _chat(tokenizer, "Describe a person as JSON, please.")
    params = SamplingParams(
        max_tokens=96, temperature=1.0, seed=7, grammar=build.json_schema(PERSON)
    )
    whole = await make_engine()
    expected = await _texts(whole.add_request(prompt, params))
    prefill, decode = await make_engine(), await make_engine()
    outs = [o async for o in prefill.add_request(prompt, params, request_id="r", prefill_only=True)]
    first = outs[-1].token_ids[0]
    data = await prefill.export_pages(outs[-1].page_table[: pages_for(len(prompt), 16)])
    await prefill.release("r")
    pages = await decode.reserve("r", prompt, params)
    await decode.import_pages(pages, data)
    got = await _texts(decode.decode_imported("r", first))
    assert got == expected and expected[2] == "stop"
    jsonschema.validate(json.loads(got[1]), PERSON)
