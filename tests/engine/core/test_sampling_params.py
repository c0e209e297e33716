"""SamplingParams: vLLM defaults, ValueError naming the field, JSON round trip."""

from __future__ import annotations

import orjson
import pytest

from libs.common.engine.core.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids) == (None, (), ())
    assert (p.ignore_eos, p.logprobs) == (False, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -2),
        ("min_p", 1.5),
        ("seed", -1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("stop", [""]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "yes"),
        ("logprobs", 21),
    ],
)
def test_a_bad_value_raises_value_error_naming_the_field(field: str, value: object):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_json_round_trip_preserves_every_field():
    p = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3,
        repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=-0.2,
        stop=["\n\n", "END"], stop_token_ids=[2], ignore_eos=True, logprobs=5,
    )  # fmt: skip
    assert SamplingParams.from_dict(orjson.loads(orjson.dumps(p.to_dict()))) == p


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"max_tokens": 4, "best_of": 2})


def test_openai_shapes_are_normalized():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ("###",) and p.top_k == 0 and p.temperature == 0.0


def test_greedy_means_temperature_zero_or_top_k_one():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy
