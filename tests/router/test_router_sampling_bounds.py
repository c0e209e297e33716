"""Sampling fields and bounds are defined once (engine/core/sampling_params.py): a value out
of a bound is refused by the API (400 naming the parameter), the wire (MessageError on
decode) and the engine (ValueError naming the field), all from the same table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import orjson
import pytest

from libs.common.engine.core.sampling_params import BOUNDS, SamplingParams
from libs.common.messages.control import GenerateRequest, MessageError, SamplingSpec
from services.router.errors import ApiError
from services.router.formats.openai.validation import parse_request


def _outside(name: str) -> list[int | float]:
    """Values just past each end of the field's bound."""
    b = BOUNDS[name]
    step = 1 if b.kind is int else 0.5
    out = []
    if b.lo is not None:
        out.append(b.lo if b.lo_open else b.lo - step)
    if b.hi is not None:
        out.append(b.hi + step)
    return out


CASES = [(name, value) for name in BOUNDS for value in _outside(name)]


@pytest.mark.parametrize(("name", "value"), CASES)
def test_the_api_refuses_a_value_out_of_bounds_with_400_naming_it(name, value):
    with pytest.raises(ApiError) as e:
        parse_request("completions", {"model": "m", "prompt": "hi", name: value}, max_n=4)
    assert e.value.status == 400 and e.value.param == name and name in e.value.message


@pytest.mark.parametrize(("name", "value"), CASES)
def test_the_engine_refuses_a_value_out_of_bounds_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(("name", "value"), CASES)
def test_the_wire_refuses_a_value_out_of_bounds_naming_it(name, value):
    body = orjson.loads(
        GenerateRequest(
            request_id="r", token_ids=[1], sampling=SamplingSpec(), stream_subject="s"
        ).encode()
    )
    body["sampling"][name] = value
    with pytest.raises(MessageError, match=name):
        GenerateRequest.decode(orjson.dumps(body))
    with pytest.raises(ValueError, match=name):
        SamplingSpec(**{name: value})


def test_chat_fields_named_otherwise_take_the_same_bounds():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    for param, value in (("top_logprobs", BOUNDS["logprobs"].hi + 1), ("max_completion_tokens", 0)):
        with pytest.raises(ApiError) as e:
            parse_request("chat", {**chat, param: value}, max_n=4)
        assert e.value.param == param


def test_the_api_caps_temperature_where_the_engine_does():
    parse_request("completions", {"model": "m", "prompt": "x", "temperature": 2}, max_n=1)
    SamplingParams(temperature=2)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=2.01)


def test_wire_and_engine_have_the_same_fields_and_defaults():
    wire = [f.name for f in msgspec.structs.fields(SamplingSpec) if f.name != "v"]
    engine = [f.name for f in dataclasses.fields(SamplingParams)]
    assert wire == engine and set(BOUNDS) <= set(engine)
    assert SamplingParams(**{k: getattr(SamplingSpec(), k) for k in engine}) == SamplingParams()


def test_docs_api_states_each_bound_as_the_table_does():
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for name, bound in BOUNDS.items():
        assert f"| `{name}` | " in text and f"| {bound.interval} |" in text, name
