"""Reasoning end to end: the tiny Qwen3 model of tests/router/tiny_qwen3.py (it thinks "ab"
and answers "Hi") served by a real cluster (nats-server, one prefill and one decode
worker, a router; the disaggregated path), its thinking split out whole and streamed, and
a grammar that applies only after `</think>`. Marked `slow` (the processes start)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.router import tiny_qwen3

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

MODEL = tiny_qwen3.MODEL
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def url(module_nats, tmp_path_factory):
    yield from tiny_qwen3.serve(module_nats.url, tmp_path_factory, "router-think")


async def chat(url: str, **fields) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, **fields}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            if not fields.get("stream"):
                return await r.json()
            events = []
            async for line in r.content:
                text = line.decode().strip()
                if text.startswith("data: ") and text != "data: [DONE]":
                    events.append(json.loads(text[len("data: ") :]))
            return {"events": events}


async def test_the_thinking_is_reasoning_content_and_the_answer_content(url):
    reply = await chat(url)
    choice = reply["choices"][0]
    assert choice["message"]["reasoning_content"] == tiny_qwen3.REASONING
    assert choice["message"]["content"] == tiny_qwen3.CONTENT
    assert choice["finish_reason"] == "stop"


async def test_streamed_the_thinking_comes_as_reasoning_content_deltas_none_empty(url):
    events = (await chat(url, stream=True))["events"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == tiny_qwen3.REASONING
    assert "".join(d.get("content", "") for d in deltas[1:]) == tiny_qwen3.CONTENT
    assert all(deltas[1:-1]), deltas  # only the role event opens with empty content
    assert finishes[-1] == "stop"


async def test_a_grammar_applies_after_the_thinking_only(url):
    # Under "Yo" from the first token the model could not think ("<think>" is masked);
    # after </think> it must write "Yo" where it would write "Hi". Greedy: where "H" is
    # masked the allowed tokens tie, and the first of them, "Y", comes before whitespace.
    reply = await chat(url, regex="Yo", temperature=0)
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == tiny_qwen3.REASONING
    assert message["content"] == "Yo"


async def test_a_cut_while_thinking_has_reasoning_and_no_content(url):
    reply = await chat(url, max_tokens=2)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "a"
    assert not choice["message"]["content"]


async def test_enable_thinking_false_closes_the_thinking_in_the_prompt_and_splits_nothing(url):
    # The template renders an empty, closed thinking part; this model thinks after any
    # "\n" regardless, and with the thinking closed its text is all answer.
    reply = await chat(url, chat_template_kwargs={"enable_thinking": False})
    message = reply["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"] == f"<think>{tiny_qwen3.REASONING}</think>{tiny_qwen3.CONTENT}"


async def post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_responses_leave_the_thinking_out_of_the_answer(url):
    # No reasoning item yet: the thinking is not shown, and never leaks into the text.
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 16, "store": False}
    response = await post(url, "/v1/responses", body)
    texts = [p["text"] for item in response["output"] for p in item.get("content", [])]
    assert texts == [tiny_qwen3.CONTENT]
