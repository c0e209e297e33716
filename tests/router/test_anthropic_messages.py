"""POST /v1/messages with the real `anthropic` SDK against a real cluster (two prefill
workers, one decode worker, the default model: tests/router/structured_cluster.py): text,
stop reasons, streaming events, tools with a tool_result round trip, count_tokens; and
one round of langchain-openai on /v1/chat/completions with a tool bound.

Every prompt is past the router's disaggregation threshold (a long system prompt), so
each request runs through prefill and decode workers. Slow: marked `slow`.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI

from tests.router.structured_cluster import long_messages, prefill_routes, structured_fixtures

pytestmark = pytest.mark.slow

cluster, c = structured_fixtures("anthropic-logs")

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
# This SDK has no sampling keywords (newer models fix them); the API still takes them.
GREEDY = {"extra_body": {"temperature": 0.0}}
HOT = {"extra_body": {"temperature": 1.0}}


@pytest.fixture
async def claude(cluster):
    async with anthropic.AsyncAnthropic(
        base_url=cluster.url, api_key="none", max_retries=0, timeout=240
    ) as client:
        yield client


def _ask(question: str) -> dict:
    """A long system prompt (past the disaggregation threshold) and one user turn."""
    system, user = long_messages(question)
    return {"system": system["content"], "messages": [user]}


async def test_create_answers_with_a_text_message_through_prefill_and_decode(cluster, claude):
    before = await prefill_routes(cluster.url)
    ask = _ask("What is the capital of France?")
    m = await claude.messages.create(model="default", max_tokens=24, **ask, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 24
    counted = await claude.messages.count_tokens(model="default", **ask)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens
    assert await prefill_routes(cluster.url) > before


async def test_max_tokens_ends_the_message_with_stop_reason_max_tokens(claude):
    ask = _ask("Write a long story about a dragon and a knight.")
    m = await claude.messages.create(model="default", max_tokens=3, **ask, **GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


async def test_a_stop_sequence_ends_the_message_and_is_named(claude):
    ask = _ask("Name the planets of the solar system, one a line.")
    whole = await claude.messages.create(model="default", max_tokens=40, **ask, **GREEDY)
    text = whole.content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    m = await claude.messages.create(
        model="default", max_tokens=40, **ask, **GREEDY, stop_sequences=[stop, "\u2603"]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.find(stop)]


async def test_a_prefill_is_continued_not_repeated(claude):
    ask = _ask("What is the capital of France?")
    prefill = "The capital of France is"
    history = [*ask["messages"], {"role": "assistant", "content": prefill}]
    m = await claude.messages.create(
        model="default", max_tokens=8, system=ask["system"], messages=history, **GREEDY
    )
    text = m.content[0].text
    assert "Paris" in text and not text.startswith(prefill), text
    plain = await claude.messages.count_tokens(model="default", **ask)
    counted = await claude.messages.count_tokens(
        model="default", system=ask["system"], messages=history
    )
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens
    assert counted.input_tokens > plain.input_tokens


async def test_a_tool_call_cut_by_max_tokens_leaks_no_markup(claude):
    ask = _ask("What is the weather in Madrid?")
    m = await claude.messages.create(
        model="default", max_tokens=6, **ask, **HOT, tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["text"] and "<tool_call" not in m.content[0].text
    async with claude.messages.stream(
        model="default", max_tokens=6, **ask, **HOT, tools=[WEATHER], tool_choice={"type": "any"}
    ) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert all(b.type == "text" and "<tool_call" not in b.text for b in final.content)


async def test_stream_events_come_in_anthropics_order_and_add_up_to_the_message(claude):
    ask = _ask("What is gravity?")
    whole = await claude.messages.create(model="default", max_tokens=30, **ask, **GREEDY)
    events = []
    async with claude.messages.stream(model="default", max_tokens=30, **ask, **GREEDY) as s:
        async for event in s:
            events.append(event)
        final = await s.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "ping")]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


async def test_tool_use_and_tool_result_round_trip(claude):
    ask = _ask("What is the weather in Paris?")
    m = await claude.messages.create(
        model="default", max_tokens=200, **ask, **HOT, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    result = {"type": "tool_result", "tool_use_id": calls[0].id, "content": "18 C, sunny"}
    history = [*ask["messages"], {"role": "assistant", "content": m.content},
               {"role": "user", "content": [result]}]  # fmt: skip
    then = {"system": ask["system"], "messages": history, "tools": [WEATHER],
            "tool_choice": {"type": "none"}}  # fmt: skip
    answer = await claude.messages.create(model="default", max_tokens=30, **then, **GREEDY)
    assert [b.type for b in answer.content] == ["text"]
    assert answer.stop_reason in ("end_turn", "max_tokens")
    first = await claude.messages.count_tokens(
        model="default", **ask, tools=[WEATHER], tool_choice={"type": "none"}
    )
    second = await claude.messages.count_tokens(model="default", **then)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == second.input_tokens
    assert second.input_tokens > first.input_tokens


async def test_a_streamed_tool_call_is_a_tool_use_block_with_input_json_deltas(claude):
    ask = _ask("What is the weather in Rome?")
    async with claude.messages.stream(
        model="default", max_tokens=200, **ask, **HOT, tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as s:  # fmt: skip
        events = [e async for e in s]
        final = await s.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert starts == ["tool_use"] and "input_json_delta" in deltas
    assert final.stop_reason == "tool_use"
    (call,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])


async def test_output_config_json_schema_is_enforced(claude):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    ask = _ask("What is the capital of Italy? Answer in JSON.")
    m = await claude.messages.create(
        model="default", max_tokens=60, **ask, **HOT,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


async def test_langchain_openai_round_with_a_bound_tool(cluster):
    openai_tool = {
        "type": "function",
        "function": {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    chat = ChatOpenAI(
        model="default", base_url=f"{cluster.url}/v1", api_key="none", max_retries=0,
        temperature=1.0, max_tokens=200, timeout=240,
    )  # fmt: skip
    system, user = long_messages("What is the weather in Oslo?")
    history = [SystemMessage(system["content"]), HumanMessage(user["content"])]
    called = await chat.bind_tools([openai_tool], tool_choice="get_weather").ainvoke(history)
    assert len(called.tool_calls) == 1 and called.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(called.tool_calls[0]["args"], WEATHER["input_schema"])
    result = ToolMessage("4 C, snow", tool_call_id=called.tool_calls[0]["id"])
    answer = await chat.bind_tools([openai_tool], tool_choice="none").ainvoke(
        [*history, called, result]
    )
    assert isinstance(answer.content, str) and not answer.tool_calls
