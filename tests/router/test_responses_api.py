"""POST /v1/responses end to end (services/router/requests/responses.py) with the real
`openai` client and `openai-agents` on its default Responses model, through a real
disaggregated cluster (two prefill workers, one decode worker, the default model,
nats-server with JetStream holding the stored responses).

Slow (the workers load the model): marked `slow`. The test that starts a second router
comes last.
"""

from __future__ import annotations

import json

import aiohttp
import jsonschema
import openai
import pytest

from tests.router.conftest import Routers
from tests.router.e2e_cluster import cluster_fixture, metric, openai_client, wait_healthy
from tests.router.structured_cluster import PERSON, RULES

pytestmark = pytest.mark.slow

cluster = cluster_fixture("responses-logs", ["--disagg-threshold", "32"])
INSTRUCTIONS = f"You are a helpful assistant. {RULES}"  # past the disaggregation threshold
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture
async def c(cluster):
    async with openai_client(cluster.url) as client:
        yield client


async def test_a_response_has_text_exact_usage_and_cached_tokens_on_a_repeat(cluster, c):
    ask = dict(model="default", instructions=INSTRUCTIONS, input="Name a colour.",
               max_output_tokens=12, temperature=0)  # fmt: skip
    routed = await metric(cluster.url, "tandem:router_decisions_total", role="prefill")
    r = await c.responses.create(**ask)
    # The prompt went through a prefill worker, then the decode worker (disaggregated).
    assert await metric(cluster.url, "tandem:router_decisions_total", role="prefill") > routed
    chat = await c.chat.completions.create(
        model="default", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": "Name a colour."}],
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content  # greedy: the same answer
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    again = await c.responses.create(**ask)
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert again.output_text == r.output_text


async def test_a_stream_sends_the_typed_events_in_openai_order(c):
    stream = await c.responses.create(
        model="default", instructions=INSTRUCTIONS, input="Say hello.", max_output_tokens=10,
        temperature=0, stream=True,
    )  # fmt: skip
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed" if kinds[-1] == "response.completed"
        else "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "".join(deltas) and final.usage.output_tokens > 0


async def test_forced_tools_give_function_call_items_streamed_and_not(c):
    ask = dict(
        model="default",
        instructions=INSTRUCTIONS,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=80,
        temperature=1.0,
    )
    r = await c.responses.create(**ask)  # fmt: skip
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    stream = await c.responses.create(**ask, stream=True)
    events = [e async for e in stream]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["city"]
    kinds = [e.type for e in events]
    i = kinds.index("response.function_call_arguments.delta")
    assert kinds[i - 1] == "response.output_item.added" and kinds[i + 1 :][:2] == [
        "response.function_call_arguments.done", "response.output_item.done"]  # fmt: skip
    # The call's output goes back as input: the model answers in text.
    follow = await c.responses.create(
        model="default", instructions=INSTRUCTIONS, tools=[WEATHER], max_output_tokens=20,
        input=[{"role": "user", "content": "Weather in Paris?"}, *calls,
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny, 21 C"}],
        tool_choice="none",
    )  # fmt: skip
    assert follow.output_text and follow.output[0].type == "message"


async def test_text_format_json_schema_is_enforced(c):
    r = await c.responses.create(
        model="default", instructions=INSTRUCTIONS, input="Make up a person.",
        max_output_tokens=200, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), PERSON)


async def test_unknown_fields_and_previous_ids_are_400s_naming_them(c):
    with pytest.raises(openai.BadRequestError) as e:
        await c.responses.create(model="default", input="x", extra_body={"cache_salt": "s"})
    assert e.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError) as e:
        await c.responses.create(model="default", input="x",
                                 previous_response_id="resp_" + "0" * 32)  # fmt: skip
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve("resp_" + "1" * 32)


async def test_openai_agents_runs_on_its_default_responses_model(cluster):
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async with openai_client(cluster.url) as client:
        model = OpenAIResponsesModel(model="default", openai_client=client)
        settings = ModelSettings(temperature=0, max_tokens=60)
        plain = Agent(name="plain", instructions=INSTRUCTIONS, model=model,
                      model_settings=settings)  # fmt: skip
        result = await Runner.run(plain, "Say hello.")
        assert isinstance(result.final_output, str) and result.final_output
        tools = Agent(
            name="weather", instructions=INSTRUCTIONS, model=model, tools=[get_weather],
            model_settings=ModelSettings(temperature=1.0, max_tokens=200, tool_choice="required",
                                         parallel_tool_calls=False),
            tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        result = await Runner.run(tools, "What is the weather in Paris?")
        assert calls and result.final_output == f"sunny in {calls[0]}"
        streamed = Runner.run_streamed(plain, "Say hi.")
        kinds = [e.type async for e in streamed.stream_events()]
        assert "raw_response_event" in kinds and streamed.final_output


async def test_a_conversation_continues_through_another_router_and_after_its_restart(
    cluster, module_nats, tmp_path, c
):
    first = await c.responses.create(
        model="default", input="My name is Ada. Say ok.",
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    not_stored = await c.responses.create(model="default", input="x", max_output_tokens=2,
                                          store=False)  # fmt: skip
    routers = Routers(module_nats.url, tmp_path)
    try:
        url = await routers.astart("router-r2", "--disagg-threshold", "32")
        await wait_healthy(url, {"prefill": 2, "decode": 1}, 60)
        async with openai_client(url) as c2:
            second = await c2.responses.create(
                model="default", input="What is my name?", previous_response_id=first.id,
                max_output_tokens=8, temperature=0,
            )  # fmt: skip
            assert second.previous_response_id == first.id
            # The stored conversation was the prompt: more input tokens than the new turn.
            assert second.usage.input_tokens > first.usage.input_tokens
            assert (await c2.responses.retrieve(first.id)).output_text == first.output_text
            items = [i async for i in c2.responses.input_items.list(second.id, limit=1)]
            assert [(i.type, i.role, i.content[0].text) for i in items] == [
                ("message", "user", "What is my name?")
            ]  # this response's input only
            with pytest.raises(openai.BadRequestError):
                await c2.responses.input_items.list(second.id, extra_query={"limit": 0})
            with pytest.raises(openai.NotFoundError):
                await c2.responses.retrieve(not_stored.id)
        routers.stop()  # a fresh process: the bucket is JetStream's, not the router's
        url = await routers.astart("router-r2", "--disagg-threshold", "32")
        async with openai_client(url) as c2:
            assert (await c2.responses.retrieve(second.id)).output_text == second.output_text
            await c2.responses.delete(second.id)
            with pytest.raises(openai.NotFoundError):
                await c2.responses.retrieve(second.id)
            with pytest.raises(openai.BadRequestError) as e:
                await c2.responses.create(model="default", input="x",
                                          previous_response_id=second.id)  # fmt: skip
            assert e.value.body["code"] == "previous_response_not_found"
        async with aiohttp.ClientSession() as http:
            async with http.delete(f"{url}/v1/responses/{second.id}") as r:
                assert r.status == 404
    finally:
        routers.stop()


async def test_the_sdk_stream_and_parse_helpers_accept_the_events_and_the_schema(c):
    """`responses.stream` rebuilds the response from the events (it checks their indexes);
    `responses.parse` sends a pydantic model as text.format and reads the answer into it."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(min_length=1, max_length=20)
        population: int = Field(ge=0, le=50_000_000)

    async with c.responses.stream(
        model="default", instructions=INSTRUCTIONS, input="Say hello.", max_output_tokens=10,
        temperature=0,
    ) as stream:  # fmt: skip
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.output_text == "".join(texts) and final.id.startswith("resp_")
    parsed = await c.responses.parse(
        model="default", instructions=INSTRUCTIONS, input="Describe Paris.",
        text_format=City, max_output_tokens=150, temperature=1.0,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


async def test_included_logprobs_cover_every_output_token_streamed_and_not(c):
    ask = dict(model="default", instructions=INSTRUCTIONS, input="Name a fruit.",
               max_output_tokens=8, temperature=0, top_logprobs=2,
               include=["message.output_text.logprobs"])  # fmt: skip
    r = await c.responses.create(**ask)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(x.top_logprobs) == 2 for x in lps)
    assert "".join(x.token for x in lps) == r.output_text
    stream = await c.responses.create(**ask, stream=True)
    events = [e async for e in stream]
    streamed = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    # Equal tokens; values to within the kernels' batch-dependent rounding.
    assert [x.token for x in streamed] == [x.token for x in lps]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in lps], abs=1e-2)
