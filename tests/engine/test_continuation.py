"""A request continued from tokens another worker generated (`generated`, a migrated
request): its outputs equal the rest of the uninterrupted run, token for token and in text,
with the real default model.
"""

from __future__ import annotations

import json

import jsonschema

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.grammar import build
from tests.engine.test_grammar import PERSON, _chat

PROMPT = "Write a short story about a lighthouse keeper."


def _outputs(core, rid, prompt, params, generated=()):
    first = core.add(rid, prompt, params, generated=list(generated))
    outs = [first] if first is not None else []
    while not (outs and outs[-1].finished):
        outs += [o for o in core.step() if o.request_id == rid]
    return outs


def _split(outs, k):
    """(ids, text) of the first k tokens' outputs, and the whole run's."""
    ids = [t for o in outs for t in o.token_ids]
    head = "".join(o.text for o in outs[:k])
    return ids, head, "".join(o.text for o in outs)


def _check_continuations(make_core, prompt, params, cuts):
    """The whole run on one engine, each continuation on a fresh one (no cache shared: as
    on another worker, the generated tokens' KV is computed by a prefill there)."""
    whole = _outputs(make_core(), "whole", prompt, params)
    ids, _, text = _split(whole, 0)
    for k in cuts:
        _, head, _ = _split(whole, k)
        rest = _outputs(make_core(), f"cont-{k}", prompt, params, ids[:k])
        assert [t for o in rest for t in o.token_ids] == ids[k:], k
        assert head + "".join(o.text for o in rest) == text, k
        last = rest[-1]
        assert last.finish_reason == whole[-1].finish_reason
        assert last.num_output_tokens == len(ids) and last.num_prompt_tokens == len(prompt)
    return text


def test_greedy_continuation_equals_the_uninterrupted_run(make_core, tokenizer):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    _check_continuations(make_core, _chat(tokenizer, PROMPT), params, (1, 17, 39))


def test_seeded_sampling_continues_the_same_random_stream(make_core, tokenizer):
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=7, ignore_eos=True)
    _check_continuations(make_core, _chat(tokenizer, PROMPT), params, (5, 20))


def test_penalties_count_the_generated_tokens_as_output(make_core, tokenizer):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.8,
                            presence_penalty=0.5)  # fmt: skip
    _check_continuations(make_core, _chat(tokenizer, PROMPT), params, (4, 19))


def test_a_stop_string_spanning_the_cut_still_ends_the_text_once(make_core, tokenizer):
    core = make_core()
    prompt = _chat(tokenizer, PROMPT)
    free = _outputs(core, "free", prompt, SamplingParams(max_tokens=40, temperature=0))
    text = "".join(o.text for o in free)
    stop = text[60:70]  # somewhere in the middle, longer than one token
    params = SamplingParams(max_tokens=40, temperature=0, stop=(stop,))
    out = _check_continuations(make_core, prompt, params, (3, 10, 14))
    assert out == text[: text.index(stop)]


def test_a_constrained_continuation_replays_the_grammar_and_stays_valid(make_core, tokenizer):
    grammar = build.json_schema(PERSON)
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=3, grammar=grammar)
    text = _check_continuations(make_core, _chat(tokenizer, "Describe a person as JSON."), params,
                                (1, 6, 12))  # fmt: skip
    jsonschema.validate(json.loads(text), PERSON)


def test_tokens_that_already_end_the_request_finish_it_at_once(make_core, tokenizer):
    core = make_core()
    prompt = _chat(tokenizer, PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = [t for o in _outputs(core, "whole", prompt, params) for t in o.token_ids]
    outs = _outputs(core, "done", prompt, params, ids)
    assert len(outs) == 1 and outs[0].token_ids == [] and outs[0].text == ""
    assert outs[0].finish_reason == "length" and outs[0].num_output_tokens == 6
    assert not core.has_work()
