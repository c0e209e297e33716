"""Request validation: every bad value is a 400 naming the parameter; good ones parse."""

import pytest

from libs.common.engine.load.source import load_tokenizer
from services.router.errors import ApiError
from services.router.formats.openai.validation import parse_request
from services.router.requests.prompts import prepare

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def bad(endpoint, body, param):
    with pytest.raises(ApiError) as e:
        parse_request(endpoint, body, max_n=4)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert param is None or param in e.value.message
    return e.value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"), ("temperature", -0.1), ("temperature", 2.5),
        ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("min_p", 2),
        ("max_tokens", 0), ("max_tokens", True), ("n", 0), ("n", 5), ("seed", -1),
        ("stop", 3), ("stop", [""]), ("stop", ["a"] * 17), ("presence_penalty", 3),
        ("frequency_penalty", "x"), ("repetition_penalty", 0), ("stream", "yes"),
        ("logprobs", 21), ("echo", 1), ("stop_token_ids", [-1]), ("model", 7),
        ("logit_bias", {"1": 101}), ("best_of", 3), ("suffix", "x"), ("user", 5),
    ],
)  # fmt: skip
def test_completions_bad_value_is_400_naming_the_field(field, value):
    bad("completions", {**COMP, field: value}, field)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages"),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
        ({"messages": CHAT["messages"]}, "model"),
    ],
)
def test_chat_bad_body_is_400_naming_the_field(body, param):
    bad("chat", body, param)


@pytest.mark.parametrize("body", [[1, 2], "text", None, 3])
def test_body_that_is_not_an_object_is_400(body):
    bad("completions", body, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ("regex", "[0-9]+"), ("ebnf", "root ::= \"a\""),
    ],
)  # fmt: skip
def test_a_grammar_field_becomes_the_requests_grammar_on_both_endpoints(field, value):
    for endpoint, body in (("chat", CHAT), ("completions", COMP)):
        req = parse_request(endpoint, {**body, field: value}, 4)
        assert req.grammar is not None and req.grammar.param == field
        assert "grammar" not in req.sampling  # built off the loop by lifecycle.check


def _json_schema(spec: dict) -> dict:
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"regex": "a", "ebnf": "root ::= \"a\""}, "ebnf"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": _json_schema({"name": "a b"})}, "response_format"),
        ({"response_format": _json_schema({"name": "a"})}, "response_format"),
        ({"response_format": _json_schema({"name": "a", "schema": 3})}, "response_format"),
        ({"regex": ""}, "regex"),
        ({"regex": 5}, "regex"),
        ({"ebnf": " "}, "ebnf"),
    ],
)  # fmt: skip
def test_a_malformed_or_second_grammar_is_400_naming_the_field(extra, param):
    bad("chat", {**CHAT, **extra}, param)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("field", ["tools", "tool_choice", "functions", "function_call"])
def test_tool_fields_on_completions_are_refused(field):
    value = [TOOL] if field in ("tools", "functions") else "auto"
    err = bad("completions", {**COMP, field: value}, field)
    assert "chat" in err.message


def test_forced_tool_calls_are_the_requests_grammar_and_auto_is_not():
    forced = parse_request("chat", {**CHAT, "tools": [TOOL], "tool_choice": "required"}, 4)
    assert forced.grammar is not None and forced.grammar.kind == "tools"
    assert forced.tools is not None and forced.tools.forced
    auto = parse_request("chat", {**CHAT, "tools": [TOOL], "tool_choice": "auto"}, 4)
    assert auto.tools is not None and auto.grammar is None and "grammar" not in auto.sampling


def test_forced_tool_calls_and_a_response_format_are_400():
    body = {**CHAT, "tools": [TOOL], "tool_choice": "required",
            "response_format": {"type": "json_object"}}  # fmt: skip
    bad("chat", body, "tool_choice")


def test_neutral_response_format_and_tool_choice_are_accepted():
    parse_request("chat", {**CHAT, "response_format": {"type": "text"}, "tool_choice": "none"}, 4)


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [[1], "a"], {"a": 1}, [2**31]])
def test_prompt_of_the_wrong_shape_is_400(prompt):
    bad("completions", {**COMP, "prompt": prompt}, "prompt")


def test_good_completion_request_parses_with_openai_defaults():
    r = parse_request("completions", {**COMP, "prompt": ["a", "b"], "n": 2, "stop": "x",
                                      "temperature": 0}, max_n=4)  # fmt: skip
    assert (r.prompts, r.n, r.max_tokens, r.stream, r.echo) == (["a", "b"], 2, 16, False, False)
    assert r.sampling["stop"] == ["x"] and r.sampling["temperature"] == 0


def test_chat_request_parses_parts_roles_and_logprobs():
    body = {**CHAT, "messages": [{"role": "developer", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
            "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = parse_request("chat", body, max_n=4)
    assert r.messages == [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"}]  # fmt: skip
    assert (r.logprobs, r.max_tokens, r.include_usage) == (3, 5, True)
    assert parse_request("chat", CHAT, max_n=4).max_tokens is None  # up to the context


@pytest.fixture(scope="module")
def tokenizer():
    tok, _model_id, _ctx = load_tokenizer("default")
    return tok


def test_prompt_longer_than_the_context_says_both_lengths(tokenizer):
    api = parse_request("completions", {**COMP, "prompt": list(range(1, 101)), "max_tokens": 50},
                        max_n=1)  # fmt: skip
    with pytest.raises(ApiError) as e:
        prepare(api, tokenizer, max_model_len=120)
    assert e.value.status == 400 and "120" in e.value.message and "150" in e.value.message
    chat = parse_request("chat", {**CHAT, "messages": [{"role": "user", "content": "x " * 200}]},
                         max_n=1)  # fmt: skip
    with pytest.raises(ApiError, match="maximum context length is 100"):
        prepare(chat, tokenizer, max_model_len=100)


def test_prepare_fills_max_tokens_up_to_the_context_and_checks_vocabulary(tokenizer):
    chat = parse_request("chat", CHAT, max_n=1)
    (p,) = prepare(chat, tokenizer, max_model_len=1000)
    assert p.sampling.max_tokens == 1000 - len(p.token_ids)
    api = parse_request("completions", {**COMP, "prompt": [tokenizer.vocab_size]}, max_n=1)
    with pytest.raises(ApiError, match="vocabulary"):
        prepare(api, tokenizer, max_model_len=1000)
