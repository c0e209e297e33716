"""llm_programs against a real Tandem stack (conftest.Stack: the default model, a real
nats-server, one prefill and one decode worker, a router): each program's greedy results
equal the same /v1/completions calls made by hand with aiohttp, and a fork's branches
find their shared prefix in the cache."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
from typing import Any

import aiohttp
import jsonschema
import pytest

from llm_programs import CallError, Router, function, gen
from llm_programs.examples import EXAMPLES

pytestmark = pytest.mark.slow

DOC = " ".join(
    f"Note {i}: the bridge number {i} crosses the river at mile {3 * i}." for i in range(24)
)
PAGE = 16  # the workers' page size: the cache holds whole pages


async def by_hand(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def hand_gen(prompt: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        **fields,
    }


async def hand_select(url: str, prefix: str, choices: list[str]) -> tuple[str, list[float]]:
    sums = []
    for choice in choices:
        out = await by_hand(
            url,
            {
                "model": "default",
                "prompt": prefix + choice,
                "echo": True,
                "logprobs": 0,
                "max_tokens": 0,
                "prompt_logprobs_from": len(prefix),
            },
        )
        sums.append(sum(x for x in out["choices"][0]["logprobs"]["token_logprobs"] if x))
    return choices[max(range(len(choices)), key=lambda i: (sums[i], -i))], sums


async def test_a_greedy_gen_equals_the_same_completion_by_hand(stack):
    @function
    async def prog(s):
        s += "The capital of France is"
        await s.gen("a", 12, temperature=0)
        s += "\nThe capital of Italy is"
        await s.gen("b", 12, temperature=0, stop="\n")

    state = await prog.arun(Router(stack.url))
    a = (await by_hand(stack.url, hand_gen("The capital of France is", 12)))["choices"][0]
    prompt_b = "The capital of France is" + a["text"] + "\nThe capital of Italy is"
    b = (await by_hand(stack.url, hand_gen(prompt_b, 12, stop=["\n"])))["choices"][0]
    assert (state["a"], state["b"]) == (a["text"], b["text"])
    assert state.text == prompt_b + b["text"]


async def test_streamed_pieces_add_up_to_the_non_streamed_output(stack):
    @function
    async def prog(s):
        s += "List three colors:"
        await s.gen("colors", 24, temperature=0)

    run = prog.stream(Router(stack.url))
    pieces = [p async for p in run]
    assert len(pieces) > 1 and {p.name for p in pieces} == {"colors"}
    assert "".join(p.text for p in pieces) == run.state["colors"]
    assert run.state["colors"] == (await prog.arun(Router(stack.url)))["colors"]


async def test_regex_and_json_schema_gens_hold_to_their_grammar(stack):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city", "year"],
    }

    @function
    async def prog(s):
        s += "Paris was founded in the year "
        await s.gen("year", 6, regex=r"[0-9]{1,4}", temperature=0)
        s += ".\nAs JSON: "
        await s.gen("record", 40, json_schema=schema, temperature=0)

    state = await prog.arun(Router(stack.url))
    assert re.fullmatch(r"[0-9]{1,4}", state["year"])
    jsonschema.validate(json.loads(state["record"]), schema)
    prompt = f"Paris was founded in the year {state['year']}.\nAs JSON: "
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
    hand = await by_hand(stack.url, hand_gen(prompt, 40, response_format=rf))
    assert state["record"] == hand["choices"][0]["text"]


async def test_run_batch_answers_each_input_as_its_own_call_by_hand(stack):
    @function
    async def capital(s, country):
        s += f"The capital of {country} is"
        await s.gen("city", 6, temperature=0, stop=".")

    countries = ["France", "Spain", "Japan", "Egypt", "Peru"]
    states = await capital.arun_batch(
        Router(stack.url), [{"country": c} for c in countries], concurrency=2
    )
    for country, state in zip(countries, states, strict=True):
        body = hand_gen(f"The capital of {country} is", 6, stop=["."])
        assert state["city"] == (await by_hand(stack.url, body))["choices"][0]["text"]


async def test_a_chat_turn_equals_chat_completions_and_ends_at_the_end_of_turn(stack):
    @function
    async def chat(s):
        s.system("You answer in one short sentence.")
        s.user("What is the capital of France?")
        await s.assistant(gen("answer", 200, temperature=0))

    state = await chat.arun(Router(stack.url))
    messages = state.messages[:2]
    async with aiohttp.ClientSession() as http:
        body = {"model": "default", "messages": messages, "max_tokens": 200, "temperature": 0}
        async with http.post(f"{stack.url}/v1/chat/completions", json=body) as r:
            hand = (await r.json())["choices"][0]
    assert hand["finish_reason"] == "stop"  # the model's end of turn, well before 200
    assert state["answer"] == hand["message"]["content"]
    assert state.text.endswith(state["answer"] + "<|im_end|>\n")


async def test_a_bad_call_raises_the_routers_400_naming_the_call(stack):
    @function
    async def prog(s):
        s += "x"
        await s.gen("broken", 4, regex="(")

    with pytest.raises(CallError, match=r"prog: gen\('broken'\): the router answered 400") as e:
        await prog.arun(Router(stack.url))
    assert e.value.status == 400


async def test_fork_of_4_and_select_of_3_compute_the_shared_prefix_once(stack):
    """The issue's test: the branches' and the choices' cached tokens cover the prefix
    they share (all of it but the last, partial page; for the choices after the first,
    the question too), and the greedy results equal the same calls made by hand."""
    question = "\nQuestion: which bridge is at mile 30?\n"
    ask = "Is there a bridge at mile 30? Answer:"
    choices = [" yes", " no", " maybe"]

    @function
    async def judge(s):
        s += DOC + question
        branches = s.fork(4)
        for i, b in enumerate(branches):
            b += f"Answer {i + 1}:"
        await asyncio.gather(*(b.gen("answer", 12, stop="\n", temperature=0) for b in branches))
        s.join(branches)
        s += ask
        await s.select("verdict", choices)

    state = await judge.arun(Router(stack.url))
    calls = {c.call: c for c in state.calls}
    shared = calls["judge: fork(4) prefix"].usage.prompt_tokens
    for i in range(4):
        usage = calls[f"judge[{i}]: gen('answer')"].usage
        assert usage.cached_tokens >= shared // PAGE * PAGE, (i, usage, shared)
    for choice in choices:
        usage = calls[f"judge: select('verdict') choice {choice!r}"].usage
        assert usage.cached_tokens >= shared // PAGE * PAGE, (choice, usage, shared)
        if choice != choices[0]:  # scored after the first, which computed the question
            assert usage.cached_tokens >= (usage.prompt_tokens - 4) // PAGE * PAGE, usage

    hand = []
    for i in range(4):
        body = hand_gen(DOC + question + f"Answer {i + 1}:", 12, stop=["\n"])
        hand.append((await by_hand(stack.url, body))["choices"][0]["text"])
    assert state["answer"] == hand
    verdict, sums = await hand_select(stack.url, DOC + question + ask, choices)
    assert state["verdict"] == verdict
    # The program scores its choices side by side, the hand one after another: batched
    # differently, the sums differ in the 4th decimal (measured: 5e-4 at most).
    assert [c.logprob for c in state.scores["verdict"]] == pytest.approx(sums, abs=5e-3)


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_runs_from_its_command_line(stack, name, capsys):
    example = importlib.import_module(f"llm_programs.examples.{name}")
    assert example.main(["--base-url", stack.url, "-n", "2", "--timeout", "120"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
