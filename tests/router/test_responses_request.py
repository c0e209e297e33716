"""POST /v1/responses bodies (services/router/formats/responses/request.py): the closed
field table, input items as chat messages, and the chat checks' errors named by the
Responses fields. The stream's event order (events.py) without a cluster."""

from __future__ import annotations

import pytest

from services.router.errors import ApiError
from services.router.formats.responses.events import ResponseEvents
from services.router.formats.responses.request import FIELDS, read_body, to_api

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def api(**body):
    req = read_body({"model": "m", "input": "hi", **body})
    return req, to_api(req, [], max_n=4)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        req = read_body({"model": "m", "input": "hi", **body})
        to_api(req, [], max_n=4)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "field",
    ["cache_salt", "structured_outputs", "prompt", "conversation", "max_tokens", "messages"],
)
def test_a_field_outside_the_table_is_refused_naming_it(field):
    assert refused({field: 1}).param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [("include", ["reasoning.encrypted_content"]), ("truncation", "auto"),
     ("background", True), ("background", 0), ("reasoning", {"effort": "low"}),
     ("top_logprobs", 3), ("include", [{}]), ("input", [{"type": ["message"]}])],
)  # fmt: skip
def test_a_neutral_only_or_malformed_value_is_refused_naming_its_field(field, value):
    assert refused({field: value}).param == field
    assert field in FIELDS


def test_neutral_values_are_accepted():
    api(include=[], truncation="disabled", background=False, service_tier="auto")


def test_a_string_input_is_one_user_message_after_the_instructions():
    _, a = api(instructions="Be brief.")
    assert a.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert a.endpoint == "chat" and a.n == 1


def test_items_become_chat_messages_with_calls_and_their_outputs():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]  # fmt: skip
    _, a = api(input=items, tools=[WEATHER])
    assert [m["role"] for m in a.messages] == ["system", "user", "assistant", "tool"]
    assert a.messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert a.messages[3]["tool_call_id"] == "call_1"
    assert a.tools is not None and a.tools.names == {"get_weather"}


def test_history_comes_before_the_new_input_and_instructions_first():
    req = read_body({"model": "m", "input": "and then?", "instructions": "sys"})
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    a = to_api(req, history, max_n=1)
    assert [m["content"] for m in a.messages] == ["sys", "a", "b", "and then?"]
    assert req.input == [{"role": "user", "content": "and then?"}]  # what is stored


@pytest.mark.parametrize(
    "item",
    [{"type": "input_image", "image_url": "x"}, {"type": "reasoning", "summary": []},
     {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
     {"role": "user", "content": "x", "extra": 1}, {"role": "tool", "content": "x"}],
)  # fmt: skip
def test_unsupported_items_are_refused_naming_input(item):
    assert refused({"input": [item]}).param == "input"


def test_chat_errors_name_the_responses_fields():
    e = refused({"max_output_tokens": 0})
    assert e.param == "max_output_tokens" and "'max_output_tokens'" in e.message
    e = refused({"text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}})
    assert e.param == "text" and "'text.format.name'" in e.message


def test_text_format_json_schema_is_a_grammar_and_tools_are_flat():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _, a = api(text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert a.grammar is not None and a.grammar.param == "response_format"
    _, a = api(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert a.grammar is not None and a.grammar.param == "tools"
    assert refused({"tools": [{"type": "web_search"}]}).param == "tools"


def test_a_malformed_previous_response_id_is_not_found():
    e = refused({"previous_response_id": "resp_../../x"})
    assert e.code == "previous_response_not_found" and e.param == "previous_response_id"


def test_stream_events_come_in_openai_order_with_sequence_numbers():
    ev = ResponseEvents()
    response = {"status": "in_progress", "output": []}
    events = ev.start(response) + ev.text("Hel") + ev.text("lo")
    call = {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}
    events += ev.call(call) + ev.finish({"status": "completed"})
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done", "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done", "completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]["output"]
    assert [i["type"] for i in done] == ["message", "function_call"]
    assert done[0]["content"][0]["text"] == "Hello" and done[1]["name"] == "f"
    assert events[9]["output_index"] == 1 and events[12]["item"]["arguments"] == "{}"


def test_logprobs_are_asked_through_include_and_refused_with_tools():
    _, a = api(include=["message.output_text.logprobs"], top_logprobs=2)
    assert a.logprobs == 2
    _, a = api(include=["message.output_text.logprobs"])
    assert a.logprobs == 0
    assert api()[1].logprobs is None
    assert refused({"top_logprobs": 2}).param == "top_logprobs"  # without include
    assert refused({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}).param == (
        "include"
    )
