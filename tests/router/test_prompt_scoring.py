"""Scoring prompts over HTTP: echo with logprobs on /v1/completions, Tandem's
`prompt_logprobs_from`, max_tokens 0, and POST /v1/chat/render. A real cluster (two prefill
workers, a decode worker, the default model); prompts of 32+ tokens are prefilled by a
prefill worker, shorter ones by the decode worker: both paths are scored.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from libs.common.engine.load.source import load_tokenizer
from tests.router.e2e_cluster import cluster_fixture, openai_client

pytestmark = pytest.mark.slow

SHORT = "The capital of France is"
LONG = " ".join(f"Fact {i}: the river number {i} flows to the sea." for i in range(12))


cluster = cluster_fixture("scoring-logs", ["--disagg-threshold", "32"])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")[0]


async def post(cluster, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(cluster.url + path, json=body) as r:
        return r.status, await r.json()


async def score(cluster, prompt: str, **extra) -> dict:
    body = {"model": "default", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    status, out = await post(cluster, "/v1/completions", {**body, **extra})
    assert status == 200, out
    return out


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["on-decode", "disaggregated"])
async def test_echo_scores_every_prompt_token_at_its_offset_and_generates_nothing(
    cluster, tokenizer, prompt
):
    out = await score(cluster, prompt, logprobs=2)
    choice, ids = out["choices"][0], tokenizer.encode(prompt)
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(top) <= 2 and top for top in lp["top_logprobs"][1:])
    for token, start in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert prompt[start : start + len(token)] == token


async def test_a_scored_continuation_has_the_logprob_it_was_generated_with(cluster):
    async with openai_client(cluster.url) as c:
        gen = await c.completions.create(model="default", prompt=SHORT, max_tokens=1,
                                         temperature=0, logprobs=0)  # fmt: skip
    word, logprob = gen.choices[0].text, gen.choices[0].logprobs.token_logprobs[0]
    out = await score(cluster, SHORT + word, prompt_logprobs_from=len(SHORT))
    lp = out["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == word and lp["text_offset"][0] == len(SHORT)
    assert lp["token_logprobs"][0] == pytest.approx(logprob, abs=2e-3)


async def test_scoring_from_an_offset_reuses_the_cached_prefix_and_equals_full_scoring(
    cluster, tokenizer
):
    prompt = LONG + " The answer is the sea."
    full = (await score(cluster, prompt))["choices"][0]["logprobs"]
    await asyncio.sleep(1.0)  # the holder's KV events reach the router, which routes to it
    part = await score(cluster, prompt, prompt_logprobs_from=len(LONG))
    lp = part["choices"][0]["logprobs"]
    k = len(full["tokens"]) - len(lp["tokens"])
    assert "".join(lp["tokens"]) == prompt[lp["text_offset"][0] :]
    assert lp["text_offset"] == full["text_offset"][k:]
    assert lp["token_logprobs"] == pytest.approx(full["token_logprobs"][k:], abs=2e-3)
    # Everything before the scored part came from a cache (page-aligned, 16 tokens).
    assert part["usage"]["prompt_tokens_details"]["cached_tokens"] >= (k - 1) // 16 * 16 - 16
    assert part["usage"]["prompt_tokens_details"]["cached_tokens"] <= k


async def test_streamed_echo_carries_the_prompt_logprobs_in_its_first_event(cluster):
    body = {"model": "default", "prompt": SHORT, "max_tokens": 2, "echo": True,
            "logprobs": 0, "temperature": 0, "stream": True}  # fmt: skip
    events = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(cluster.url + "/v1/completions", json=body) as r,
    ):
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    first = events[0]["choices"][0]
    assert first["text"] == SHORT and first["logprobs"]["token_logprobs"][0] is None
    rest = [e["choices"][0] for e in events[1:] if e["choices"]]
    assert sum(len(c["logprobs"]["tokens"]) for c in rest if c["logprobs"]) == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "prompt_logprobs_from": 3}, "prompt_logprobs_from"),
        ({"logprobs": 0, "prompt_logprobs_from": 3}, "prompt_logprobs_from"),
        ({"echo": True, "logprobs": 0, "prompt_logprobs_from": -1}, "prompt_logprobs_from"),
        (
            {"echo": True, "logprobs": 0, "prompt_logprobs_from": 0, "prompt": [1, 2, 3]},
            "prompt_logprobs_from",
        ),
        ({"echo": True, "logprobs": 20, "prompt": LONG * 8}, "logprobs"),
    ],
)
async def test_scoring_requests_that_cannot_be_served_are_400s_naming_the_field(
    cluster, body, param
):
    status, out = await post(cluster, "/v1/completions",
                             {"model": "default", "prompt": SHORT, **body})  # fmt: skip
    assert status == 400 and out["error"]["param"] == param, out


async def test_chat_render_gives_the_prompt_chat_completions_runs(cluster, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]  # fmt: skip
    status, out = await post(cluster, "/v1/chat/render", {"messages": messages})
    assert status == 200 and out["object"] == "chat.prompt"
    assert out["prompt"] == tokenizer.apply_chat_template(messages)
    assert out["prompt_tokens"] == len(tokenizer.encode(out["prompt"]))
    async with openai_client(cluster.url) as c:
        chat = await c.chat.completions.create(model="default", messages=messages,
                                               max_tokens=8, temperature=0)  # fmt: skip
        text = await c.completions.create(model="default", prompt=out["prompt"],
                                          max_tokens=8, temperature=0)  # fmt: skip
    assert chat.usage.prompt_tokens == text.usage.prompt_tokens == out["prompt_tokens"]
    assert chat.choices[0].message.content == text.choices[0].text
    status, bad = await post(cluster, "/v1/chat/render", {"messages": messages, "tools": []})
    assert status == 400 and bad["error"]["param"] == "tools"
    status, bad = await post(cluster, "/v1/chat/render", {"messages": []})
    assert status == 400 and bad["error"]["param"] == "messages"
