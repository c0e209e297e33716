"""Tool calls end to end (services/router/structured/tools/request.py): tools and
tool_choice through a real cluster (tests/router/structured_cluster.py), the calls valid
against their functions' schemas, whole and streamed.

Answers are sampled at temperature 1 with a seed, so only an enforced grammar makes them
valid. Slow (the workers load the model): marked `slow`. Requests within a test run
concurrently.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.router.structured_cluster import (
    PERSON,
    long_messages,
    post,
    schema_errors,
    schema_format,
    structured_fixtures,
)

pytestmark = pytest.mark.slow

cluster, c = structured_fixtures("tools-logs")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}/[A-Z][a-z]{1,10}$"}
            },
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def tool_call_errors(calls: list[Any]) -> list[str]:
    """Why each of `calls` (name, arguments) is not a call of one of TOOLS."""
    errors = []
    for name, arguments in calls:
        if name not in TOOLS:
            errors.append(f"unknown function {name!r}")
        elif why := schema_errors(arguments, TOOLS[name]):
            errors.append(f"{name}: {why}")
    return errors


async def test_tools_required_gives_valid_tool_calls(cluster, c):
    async def one(seed: int) -> list[str]:
        r = await c.chat.completions.create(
            model="default", messages=long_messages("What is the weather in Paris?"),
            max_tokens=600, temperature=1.0, seed=seed, tools=[WEATHER, CLOCK],
            tool_choice="required",
        )  # fmt: skip
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        errors = tool_call_errors([(t.function.name, t.function.arguments) for t in calls])
        if (
            not calls
            or choice.finish_reason != "tool_calls"
            or len({t.id for t in calls}) != len(calls)
        ):
            errors.append(f"finish={choice.finish_reason} calls={calls}")
        return errors

    errors = await asyncio.gather(*(one(seed) for seed in range(3)))
    assert not any(errors), errors


async def test_tools_required_without_parallel_calls_gives_exactly_one(cluster, c):
    r = await c.chat.completions.create(
        model="default", messages=long_messages("Weather in Rome and the time in Tokyo?"),
        max_tokens=300, temperature=1.0, seed=8, tools=[WEATHER, CLOCK],
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1, calls
    assert not tool_call_errors([(calls[0].function.name, calls[0].function.arguments)])


async def test_tools_named_choice_calls_that_function_with_valid_arguments(cluster, c):
    r = await c.chat.completions.create(
        model="default", messages=long_messages("What time is it in Japan?"), max_tokens=200,
        temperature=1.0, seed=9, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    assert [t.function.name for t in calls] == ["get_time"], r.choices[0].message
    assert not tool_call_errors([("get_time", calls[0].function.arguments)])
    assert r.choices[0].finish_reason == "tool_calls"


async def test_tools_choice_none_answers_in_text_without_tool_calls(cluster, c):
    r = await c.chat.completions.create(
        model="default", messages=long_messages("What is the weather in Paris?"),
        max_tokens=16, temperature=1.0, seed=2, tools=[WEATHER], tool_choice="none",
    )  # fmt: skip
    assert not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


async def test_tools_streamed_tool_call_deltas_assemble_to_valid_calls(cluster, c):
    stream = await c.chat.completions.create(
        model="default", messages=long_messages("What is the weather in Oslo?"),
        max_tokens=300, temperature=1.0, seed=12, tools=[WEATHER, CLOCK],
        tool_choice="required", stream=True,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            if d.function:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert calls and all(call["id"] for call in calls.values()), calls
    assert not tool_call_errors([(x["name"], x["arguments"]) for x in calls.values()])


async def test_tools_a_conversation_with_a_tool_result_is_accepted(cluster, c):
    messages = [
        *long_messages("What is the weather in Paris?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    r = await c.chat.completions.create(model="default", messages=messages, max_tokens=24,
                                        temperature=1.0, seed=6, tools=[WEATHER],
                                        tool_choice="auto")  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    calls = choice.message.tool_calls or []
    assert not tool_call_errors([(t.function.name, t.function.arguments) for t in calls])


@pytest.mark.parametrize(
    "extra, params",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         {"tool_choice"}),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, {"tool_choice"}),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "foo"}}}], "tool_choice": "required"}, {"tools"}),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": schema_format(PERSON)}, {"response_format", "tools", "tool_choice"}),
    ],
    ids=["unknown-function", "unknown-choice", "bad-parameters", "tools-and-schema"],
)  # fmt: skip
async def test_tools_bad_input_is_a_400_naming_the_field(cluster, extra, params):
    body = {"model": "default", "max_tokens": 4, **extra,
            "messages": [{"role": "user", "content": "Hello"}]}  # fmt: skip
    status, reply = await post(cluster.url, "/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] in params, reply


@pytest.mark.parametrize("max_tokens", [3, 12])
async def test_tools_a_call_cut_by_max_tokens_leaks_no_markup_whole_or_streamed(
    cluster, c, max_tokens
):
    """The forced call is cut inside its block: no call, no markup or partial JSON in the
    content, finish_reason "length"; the same streamed."""
    args = dict(
        model="default", messages=long_messages("What is the weather in Paris?"),
        max_tokens=max_tokens, temperature=1.0, seed=4, tools=[WEATHER, CLOCK],
        tool_choice="required",
    )  # fmt: skip
    r = await c.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls and not choice.message.content, choice.message
    stream = await c.chat.completions.create(**args, stream=True)
    content, calls, finish = "", [], None
    async for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "length" and content == "" and not calls
