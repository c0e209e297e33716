"""Sampling defaults: for a field a request leaves out, a --default-* flag wins over the
model's own default, which wins over SamplingParams's; a field the request sets is its own."""

from __future__ import annotations

import pytest

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.generation_config import FIELDS
from libs.common.engine.load.source import load_tokenizer
from services.router.config import RouterConfig
from services.router.defaults import merge_defaults
from services.router.formats.openai.validation import parse_request
from services.router.requests.prompts import prepare

NO_FLAGS = {"temperature": None, "top_p": None, "top_k": None}


def test_the_models_defaults_apply_where_no_flag_is_given():
    d = merge_defaults({"temperature": 0.2, "top_p": 0.9}, "card", NO_FLAGS)
    assert d.values == {"temperature": 0.2, "top_p": 0.9}
    assert d.sources == {"temperature": "card", "top_p": "card"}


def test_an_explicit_flag_overrides_the_models_default_for_its_field_only():
    d = merge_defaults({"temperature": 0.2, "top_p": 0.9}, "card", {"temperature": 0.7, "top_k": 5})
    assert d.values == {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
    assert d.sources == {
        "temperature": "--default-temperature",
        "top_p": "card",
        "top_k": "--default-top-k",
    }


def test_a_field_neither_sets_is_left_to_sampling_params():
    d = merge_defaults({}, "none", NO_FLAGS)
    assert d.values == {} and d.fill({}) == {}
    assert SamplingParams(**d.fill({})).temperature == 1.0


def test_a_field_the_request_sets_always_wins_even_when_it_equals_samplingparams_default():
    d = merge_defaults({"temperature": 0.2, "top_p": 0.9}, "card", {"temperature": 0.5})
    assert d.fill({"temperature": 1.0}) == {"temperature": 1.0, "top_p": 0.9}
    assert d.fill({"temperature": 0, "top_p": 1.0}) == {"temperature": 0, "top_p": 1.0}


def test_prepare_puts_defaults_on_the_wire_only_for_fields_the_request_left_out():
    tokenizer, _, _ = load_tokenizer("default")
    d = merge_defaults({"temperature": 0.2, "top_p": 0.9}, "card", {"repetition_penalty": 1.1})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}
    (p,) = prepare(parse_request("chat", body, max_n=1), tokenizer, 1000, d)
    assert (p.sampling.temperature, p.sampling.top_p, p.sampling.repetition_penalty) == (
        0.2,
        0.5,
        1.1,
    )
    (p,) = prepare(parse_request("chat", {**body, "temperature": 1.0}, max_n=1), tokenizer, 1000, d)
    assert p.sampling.temperature == 1.0


def test_there_is_a_default_flag_for_every_field_a_model_may_set():
    assert list(RouterConfig().sampling_flags) == list(FIELDS)


def test_the_default_flags_are_unset_unless_given():
    assert set(RouterConfig().sampling_flags.values()) == {None}
    cfg = RouterConfig.parse(["--default-temperature", "0.3", "--default-top-k", "40"], env={})
    assert cfg.sampling_flags["temperature"] == 0.3 and cfg.sampling_flags["top_k"] == 40


@pytest.mark.parametrize(
    ("name", "value"),
    [("default_temperature", 2.5), ("default_top_p", 0.0), ("default_min_p", 1.5),
     ("default_repetition_penalty", 0.0), ("default_top_k", -2)],
)  # fmt: skip
def test_a_default_flag_out_of_its_bounds_is_a_value_error_naming_the_flag(name, value):
    with pytest.raises(ValueError, match="--" + name.replace("_", "-")):
        RouterConfig(**{name: value})


def test_a_greedy_request_gets_no_default_penalty():
    d = merge_defaults({"temperature": 0.2, "repetition_penalty": 1.1}, "model", {})
    assert d.fill({"temperature": 0}) == {"temperature": 0}
    assert d.fill({"top_k": 1})["top_k"] == 1 and "repetition_penalty" not in d.fill({"top_k": 1})
    assert d.fill({})["repetition_penalty"] == 1.1
    assert d.fill({"temperature": 0.7})["repetition_penalty"] == 1.1
