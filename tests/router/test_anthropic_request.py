"""Anthropic's Messages API, the parts without a cluster: a body -> the chat request
(services/router/formats/anthropic/request.py), the shapes of stop reasons, events and
errors (shapes.py), and a lone router process's x-api-key check, count_tokens and error
bodies (the SDK against a real cluster: test_anthropic_messages.py)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import anthropic
import pytest

from services.router.errors import ApiError
from services.router.formats.anthropic import request as messages
from services.router.formats.anthropic import shapes
from services.router.formats.sse import parse_sse
from tests.router.conftest import Routers

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _body(**fields) -> dict:
    hello = [{"role": "user", "content": "hi"}]
    return {"model": "m", "max_tokens": 8, "messages": hello, **fields}


def _refused(body: dict, path: str = "/v1/messages") -> ApiError:
    with pytest.raises(ApiError) as e:
        messages.parse(body, path)
    assert e.value.status == 400
    return e.value


def test_system_blocks_and_tool_round_trip_become_chat_messages():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants weather.", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}},
        ]},
    ]  # fmt: skip
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    req = messages.parse(_body(system=system, messages=history, tools=[WEATHER]), "/v1/messages")
    assert req.endpoint == "chat" and req.max_tokens == 8
    assert req.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    assert req.tools is not None and req.tools.choice == "auto" and req.grammar is None


def test_a_last_assistant_turn_is_a_prefill_the_model_continues():
    history = [{"role": "user", "content": "Capital of France?"},
               {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]  # fmt: skip
    req = messages.parse(_body(messages=history), "/v1/messages")
    assert req.messages[-1] == {"role": "assistant", "content": "It is"}
    assert req.template.continue_final_message and not req.template.add_generation_prompt
    plain = messages.parse(_body(), "/v1/messages")
    assert plain.template.add_generation_prompt and not plain.template.continue_final_message
    assert plain.template.kwargs == {}


def test_thinking_disabled_renders_the_template_without_thinking():
    req = messages.parse(_body(thinking={"type": "disabled"}), "/v1/messages")
    assert req.template.kwargs == {"enable_thinking": False}
    adaptive = messages.parse(_body(thinking={"type": "adaptive"}), "/v1/messages")
    assert adaptive.template.kwargs == {}


@pytest.mark.parametrize(
    ("choice", "chat_choice", "forced", "parallel"),
    [
        ({"type": "auto"}, "auto", False, True),
        ({"type": "any"}, "required", True, True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", True, False),
        ({"type": "tool", "name": "get_weather"}, "function", True, True),
        ({"type": "none"}, "none", False, True),
    ],
)
def test_tool_choice_maps_onto_the_chat_tool_request(choice, chat_choice, forced, parallel):
    req = messages.parse(_body(tools=[WEATHER], tool_choice=choice), "/v1/messages")
    assert req.tools is not None and req.tools.choice == chat_choice
    assert req.tools.parallel is parallel
    assert (req.grammar is not None and req.grammar.param == "tools") is forced
    assert req.tools.forced is forced


def test_sampling_fields_stop_sequences_and_user_are_carried():
    body = _body(temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["\n\n", "END"],
                 metadata={"user_id": "u-1"}, stream=True)  # fmt: skip
    req = messages.parse(body, "/v1/messages")
    assert req.sampling == {"temperature": 0.5, "top_p": 0.9, "top_k": 5,
                            "stop": ["\n\n", "END"], "stop_token_ids": []}  # fmt: skip
    assert req.user == "u-1" and req.stream


def test_output_config_json_schema_becomes_the_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    config = {"format": {"type": "json_schema", "schema": schema}}
    req = messages.parse(_body(output_config=config), "/v1/messages")
    assert req.grammar is not None and req.grammar.param == "output_config"
    assert req.grammar.kind == "json" and req.grammar.source == schema


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (_body(top_a=1), "top_a", "'top_a' is not a field of /v1/messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "required"),
        (_body(temperature=1.5), "temperature", "[0, 1]"),
        (_body(stop_sequences="END"), "stop_sequences", "list"),
        (_body(metadata={"user_id": "u", "x": 1}), "metadata", "user_id"),
        (_body(thinking={"type": "enabled", "budget_tokens": 2048}), "thinking", "thinking"),
        (_body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
         "messages", "messages[0].content[0]"),
        (_body(messages=[{"role": "user", "content": "x", "name": "n"}]), "messages", "name"),
        (_body(messages=[{"role": "user", "content": "x"}, {"role": "assistant",
                                                           "content": "The answer is "}]),
         "messages", "trailing whitespace"),
        (_body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
         "messages", "prefill"),
        (_body(tools=[{**WEATHER, "input_examples": []}]), "tools", "input_examples"),
        (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools",
         "client tools"),
        (_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice",
         "nope"),
        (_body(tool_choice={"type": "any"}), "tool_choice", "needs 'tools'"),
        (_body(cache_control={"type": "persistent"}), "cache_control", "ephemeral"),
        (_body(output_config={"effort": "high"}), "output_config", "effort"),
        (_body(tools=[WEATHER], tool_choice={"type": "any"},
               output_config={"format": {"type": "json_schema", "schema": {}}}),
         "tool_choice", "one grammar"),
    ],
)  # fmt: skip
def test_a_field_not_enforced_is_refused_naming_it(body, param, says):
    e = _refused(body)
    assert e.param == param and says in e.message


def test_count_tokens_has_its_own_table():
    req = messages.parse(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
        "/v1/messages/count_tokens",
    )
    assert req.messages == [{"role": "user", "content": "hi"}] and req.tools is not None
    e = _refused(_body(), "/v1/messages/count_tokens")
    assert e.param == "max_tokens" and "count_tokens" in e.message


@pytest.mark.parametrize(
    ("finish", "called", "sequence", "reason"),
    [
        ("stop", False, None, "end_turn"),
        ("stop", True, None, "tool_use"),
        ("stop", False, "END", "stop_sequence"),
        ("length", False, None, "max_tokens"),
        ("length", True, None, "max_tokens"),
    ],
)
def test_stop_reason(finish, called, sequence, reason):
    assert shapes.stop_reason(finish, called, sequence) == reason


def test_events_use_anthropics_framing_and_usage_splits_the_cached_prompt():
    raw = shapes.event("message_delta", {"delta": {"stop_reason": "end_turn"}})
    assert raw.startswith(b"event: message_delta\ndata: ")
    assert parse_sse(raw) == [{"type": "message_delta", "delta": {"stop_reason": "end_turn"}}]
    usage = shapes.Usage(prompt_tokens=100, output_tokens=7, cached_tokens=64).body()
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == 100
    assert usage["cache_read_input_tokens"] == 64 and usage["output_tokens"] == 7


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"),
     (404, "not_found_error"), (429, "rate_limit_error"), (503, "overloaded_error"),
     (500, "api_error"), (504, "api_error")],
)  # fmt: skip
def test_error_bodies_have_anthropics_shape(status, kind):
    body = shapes.error_body(ApiError(status, "why"))
    assert body == {"type": "error", "error": {"type": kind, "message": "why"}}


# --- a router process, no workers: keys, count_tokens, errors ----------------------------

KEY = "sk-test-anthropic"


@pytest.fixture(scope="module")
def router(module_nats, tmp_path_factory):
    routers = Routers(module_nats.url, tmp_path_factory.mktemp("anthropic-router-logs"))
    try:
        yield routers.start("router-anthropic", "--api-key", KEY)
    finally:
        routers.stop()


def _client(url: str, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


async def test_x_api_key_is_accepted_like_a_bearer_key(router):
    async with _client(router, KEY) as client:  # the SDK sends the key as x-api-key
        one = await client.messages.count_tokens(
            model="default", messages=[{"role": "user", "content": "Hello there"}]
        )
        hello = [{"role": "user", "content": "Hello there"}]
        two = await client.messages.count_tokens(model="default", messages=hello, tools=[WEATHER])
    assert 0 < one.input_tokens < two.input_tokens  # the tools are in the prompt
    async with _client(router, "wrong") as client:
        with pytest.raises(anthropic.AuthenticationError) as e:
            await client.messages.count_tokens(
                model="default", messages=[{"role": "user", "content": "Hello"}]
            )
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": e.value.body["error"]["message"]}}  # fmt: skip


async def test_errors_on_messages_paths_are_anthropic_shaped(router):
    async with _client(router, KEY) as client:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(
                model="default", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                extra_body={"logit_bias": {"1": 5}},
            )  # fmt: skip
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(
                model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "'logit_bias'" in bad.value.body["error"]["message"]
    assert missing.value.body["error"]["type"] == "not_found_error"
    async with aiohttp.ClientSession() as http:
        headers = {"x-api-key": KEY, "content-type": "application/json"}
        async with http.post(f"{router}/v1/messages", data=b"{no", headers=headers) as r:
            assert r.status == 400
            body = await r.json()
        async with http.post(f"{router}/v1/chat/completions", data=b"{no", headers=headers) as r:
            openai_body = await r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert set(openai_body["error"]) == {"message", "type", "param", "code"}  # unchanged


# --- every field of the SDK's request types: in the table with a test, or refused --------

# Each accepted field -> the test that shows its effect (module, function).
EFFECTS = {
    "model": ("test_anthropic_request", "test_errors_on_messages_paths_are_anthropic_shaped"),
    "messages": ("test_anthropic_messages", "test_tool_use_and_tool_result_round_trip"),
    "max_tokens": ("test_anthropic_messages",
                   "test_max_tokens_ends_the_message_with_stop_reason_max_tokens"),
    "system": ("test_anthropic_messages", "test_a_prefill_is_continued_not_repeated"),
    "tools": ("test_anthropic_messages", "test_tool_use_and_tool_result_round_trip"),
    "tool_choice": ("test_anthropic_messages",
                    "test_a_streamed_tool_call_is_a_tool_use_block_with_input_json_deltas"),
    "output_config": ("test_anthropic_messages", "test_output_config_json_schema_is_enforced"),
    "cache_control": ("test_anthropic_request",
                      "test_system_blocks_and_tool_round_trip_become_chat_messages"),
    "thinking": ("test_anthropic_thinking",
                 "test_thinking_disabled_closes_the_thinking_in_the_prompt"),
    "stop_sequences": ("test_anthropic_messages",
                       "test_a_stop_sequence_ends_the_message_and_is_named"),
    "stream": ("test_anthropic_messages",
               "test_stream_events_come_in_anthropics_order_and_add_up_to_the_message"),
    "temperature": ("test_anthropic_messages",
                    "test_stream_events_come_in_anthropics_order_and_add_up_to_the_message"),
    # Carried into the chat request's sampling, which the engine enforces as chat's.
    "top_p": ("test_anthropic_request", "test_sampling_fields_stop_sequences_and_user_are_carried"),
    "top_k": ("test_anthropic_request", "test_sampling_fields_stop_sequences_and_user_are_carried"),
    "metadata": ("test_anthropic_request",
                 "test_sampling_fields_stop_sequences_and_user_are_carried"),
}  # fmt: skip


def _sdk_fields(typed_dict) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


@pytest.mark.parametrize(
    ("path", "specs", "sdk"),
    [
        ("/v1/messages", messages.MESSAGES_SPECS,
         anthropic.types.message_create_params.MessageCreateParamsStreaming),
        ("/v1/messages/count_tokens", messages.COUNT_SPECS,
         anthropic.types.message_count_tokens_params.MessageCountTokensParams),
    ],
)  # fmt: skip
def test_every_sdk_field_is_accepted_with_a_test_or_refused_naming_it(path, specs, sdk):
    accepted = {s.name for s in specs}
    for name in sorted(_sdk_fields(sdk) - accepted):
        body = _body(**{name: "x"})
        if path.endswith("count_tokens"):
            del body["max_tokens"]
        e = _refused(body, path)
        assert e.param == name, (name, e.message)
    for name in sorted(accepted):
        module, test = EFFECTS[name]
        source = (Path(__file__).parent / f"{module}.py").read_text()
        assert f"def {test}(" in source, (name, module, test)
    # The sampling fields the SDK no longer lists (newer models fix them) stay accepted.
    assert accepted - _sdk_fields(sdk) <= {"temperature", "top_p", "top_k"}
