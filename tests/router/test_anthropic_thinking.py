"""/v1/messages with a reasoning model: the tiny Qwen3 of tests/router/tiny_qwen3.py (it
thinks "ab" and answers "Hi") served by a real cluster (one prefill and one decode
worker, a router), through the `anthropic` SDK: the thinking is a thinking block before
the text, whole and streamed; `thinking: {type: disabled}` renders the prompt without
thinking. Marked `slow` (the processes start)."""

from __future__ import annotations

import anthropic
import pytest

from tests.router import tiny_qwen3

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

MODEL = tiny_qwen3.MODEL
ASK = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture(scope="module")
def url(module_nats, tmp_path_factory):
    yield from tiny_qwen3.serve(module_nats.url, tmp_path_factory, "router-claude-think")


@pytest.fixture
async def claude(url):
    async with anthropic.AsyncAnthropic(
        base_url=url, api_key="none", max_retries=0, timeout=240
    ) as client:
        yield client


async def test_the_thinking_is_a_thinking_block_before_the_text(claude):
    m = await claude.messages.create(**ASK)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == tiny_qwen3.REASONING
    assert m.content[1].text == tiny_qwen3.CONTENT and m.stop_reason == "end_turn"


async def test_streamed_the_thinking_comes_as_thinking_deltas_then_the_text(claude):
    async with claude.messages.stream(**ASK) as s:
        events = [e async for e in s]
        final = await s.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=lambda t: t != "thinking_delta")  # thinking first
    assert {"thinking_delta", "text_delta"} <= set(deltas)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == tiny_qwen3.REASONING
    assert final.content[1].text == tiny_qwen3.CONTENT


async def test_thinking_disabled_closes_the_thinking_in_the_prompt(claude):
    # The template renders an empty, closed thinking part; this model writes its tags
    # after any "\n" regardless, and with the thinking closed all of it is text.
    m = await claude.messages.create(**ASK, thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == f"<think>{tiny_qwen3.REASONING}</think>{tiny_qwen3.CONTENT}"
    on = await claude.messages.count_tokens(model=MODEL, messages=ASK["messages"])
    off = await claude.messages.count_tokens(
        model=MODEL, messages=ASK["messages"], thinking={"type": "disabled"}
    )
    assert off.input_tokens > on.input_tokens  # the closed thinking part is in the prompt
