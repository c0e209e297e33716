"""vLLM's and SGLang's request fields through a real cluster with the real openai client
(`extra_body`): logit_bias, min_tokens, stop_token_ids checked against the vocabulary,
stop_reason / matched_stop, prompt_logprobs, return_token_ids and
stream_options.continuous_usage_stats.

Two routers over the same workers: `cluster.url` sends every prompt through a prefill
worker (--disagg-threshold 0: token 0 is sampled there, the rest on the decode worker);
`unified` lets the decode worker prefill every prompt itself. Greedy output with the same
logit_bias must be the same on both.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from libs.common.engine.load.source import load_tokenizer
from tests.router.conftest import Routers
from tests.router.e2e_cluster import cluster_fixture, openai_client, wait_healthy

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
cluster = cluster_fixture("vllm-fields-logs", ["--disagg-threshold", "0"])


@pytest.fixture(scope="module")
def unified(cluster, module_nats, tmp_path_factory):
    """A second router whose prompts the decode worker prefills itself."""
    routers = Routers(module_nats.url, tmp_path_factory.mktemp("unified-router"))
    try:
        url = routers.start("router-unified", "--disagg-threshold", "1000000")
        asyncio.run(wait_healthy(url, {"prefill": 2, "decode": 1}, 240))
        yield url
    finally:
        routers.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")[0]


def prefills(cluster) -> int:
    """Prompts the prefill workers have computed so far (their log's "prefill done")."""
    return (cluster.logs / "prefill.log").read_text().count("prefill done")


async def complete(url: str, **kw):
    async with openai_client(url) as c:
        return await c.completions.create(model="default", prompt=PROMPT, temperature=0, **kw)


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


async def test_logit_bias_gives_the_same_greedy_tokens_through_prefill_and_decode_alone(
    cluster, unified
):
    extra = {"return_token_ids": True}
    plain = await complete(cluster.url, max_tokens=6, extra_body=extra)
    first = ids_of(plain.choices[0])[0]
    bias = {str(first): -100, "42": 4}
    before = prefills(cluster)
    through_pd = await complete(cluster.url, max_tokens=6, logit_bias=bias, extra_body=extra)
    assert prefills(cluster) > before  # token 0 came from a prefill worker
    before = prefills(cluster)
    alone = await complete(unified, max_tokens=6, logit_bias=bias, extra_body=extra)
    assert prefills(cluster) == before  # the decode worker prefilled it itself
    pd_ids, alone_ids = ids_of(through_pd.choices[0]), ids_of(alone.choices[0])
    assert pd_ids[0] != first  # the bias applied to token 0, at the prefill worker
    assert pd_ids == alone_ids and through_pd.choices[0].text == alone.choices[0].text
    forced = await complete(cluster.url, max_tokens=4, logit_bias={"42": 100}, extra_body=extra)
    assert ids_of(forced.choices[0]) == [42] * 4  # prefill's token 0 and decode's rest


async def test_min_tokens_holds_stop_ids_back_and_stop_reason_names_the_id(cluster, tokenizer):
    stop_id = 42
    async with openai_client(cluster.url) as c:
        out = await c.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Say hi."}],
            temperature=0, max_tokens=10, logit_bias={str(stop_id): 100},
            extra_body={"min_tokens": 3, "stop_token_ids": [stop_id], "return_token_ids": True},
        )  # fmt: skip
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 4 and stop_id not in ids[:3] and ids[3] == stop_id
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    assert choice.model_extra["matched_stop"] == stop_id
    prompt_ids = out.model_extra["prompt_token_ids"]
    assert prompt_ids[-3:] == tokenizer.encode("<|im_start|>assistant\n")[-3:]


async def test_eos_at_the_prefill_worker_has_no_stop_reason_and_matches_eos(cluster, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    out = await complete(cluster.url, max_tokens=5, logit_bias={str(eos): 100})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == ""
    assert choice.model_extra["stop_reason"] is None
    assert choice.model_extra["matched_stop"] == eos
    long = await complete(cluster.url, max_tokens=2, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length"
    assert long.choices[0].model_extra["matched_stop"] is None


async def test_a_stop_string_is_the_stop_reason_streamed_in_the_last_chunk(cluster):
    text = (await complete(cluster.url, max_tokens=8)).choices[0].text
    word = text.split()[1]
    async with openai_client(cluster.url) as c:
        stream = await c.completions.create(model="default", prompt=PROMPT, temperature=0,
                                            max_tokens=8, stop=[word], stream=True)  # fmt: skip
        chunks = [chunk async for chunk in stream]
    last = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(last) == 1 and last[0].finish_reason == "stop"
    assert last[0].model_extra["stop_reason"] == word == last[0].model_extra["matched_stop"]
    assert word not in "".join(ch.choices[0].text for ch in chunks if ch.choices)


async def test_ids_outside_the_vocabulary_are_refused_naming_the_field(cluster, tokenizer):
    vocab = tokenizer.vocab_size
    for field, value in (("stop_token_ids", [vocab]), ("logit_bias", {str(vocab + 5): 1})):
        with pytest.raises(openai.BadRequestError) as e:
            await complete(cluster.url, max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        await complete(cluster.url, max_tokens=2, extra_body={"min_tokens": 3})
    assert e.value.body["param"] == "min_tokens"  # more than max_tokens


async def test_prompt_logprobs_equal_echo_scoring_in_vllms_shape(cluster, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = await complete(cluster.url, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    echo = await complete(cluster.url, max_tokens=0, echo=True, logprobs=0)
    expected = echo.choices[0].logprobs.token_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    for token, entry, want in zip(ids[1:], scored[1:], expected[1:], strict=True):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(want, abs=2e-3)
        assert own["rank"] >= 1 and own["decoded_token"] == tokenizer.decode([token])
        top = sorted(entry.values(), key=lambda x: -x["logprob"])
        assert top[0]["rank"] == 1 and len(entry) <= 3
    async with openai_client(cluster.url) as c:
        chat = await c.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"prompt_logprobs": 0},
        )  # fmt: skip
    lps = chat.model_extra["prompt_logprobs"]
    assert lps[0] is None and all(len(e) == 1 for e in lps[1:]) and len(lps) > 3
    async with openai_client(cluster.url) as c:  # streamed: in the first chunk
        stream = await c.completions.create(model="default", prompt=PROMPT, max_tokens=3,
                                            temperature=0, stream=True,
                                            extra_body={"prompt_logprobs": 2})  # fmt: skip
        chunks = [ch async for ch in stream]
    firsts = [ch.choices[0].model_extra.get("prompt_logprobs") for ch in chunks if ch.choices]
    assert firsts[0] == scored and not any(firsts[1:])
    with pytest.raises(openai.BadRequestError) as e:
        await complete(cluster.url, max_tokens=0, echo=True, logprobs=1,
                       extra_body={"prompt_logprobs": 1})  # fmt: skip
    assert e.value.body["param"] == "prompt_logprobs"


async def test_streamed_token_ids_and_continuous_usage_add_up_to_the_whole(cluster, tokenizer):
    whole = await complete(cluster.url, max_tokens=6, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode(PROMPT)
    body = {"model": "default", "prompt": PROMPT, "temperature": 0, "max_tokens": 6,
            "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    streamed, prompt_ids, usages = [], None, []
    async with aiohttp.ClientSession() as s, s.post(cluster.url + "/v1/completions",
                                                    json=body) as r:  # fmt: skip
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usages.append(chunk["usage"])
            for ch in chunk["choices"]:
                streamed += ch["token_ids"]
                prompt_ids = prompt_ids or ch.get("prompt_token_ids")
    assert streamed == ids_of(choice) and prompt_ids == tokenizer.encode(PROMPT)
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == whole.usage.completion_tokens
    assert all(u["prompt_tokens"] == whole.usage.prompt_tokens for u in usages)
    bad = {**body, "stream_options": {"continuous_usage_stats": True}}
    async with aiohttp.ClientSession() as s, s.post(cluster.url + "/v1/completions",
                                                    json=bad) as r:  # fmt: skip
        assert r.status == 400 and (await r.json())["error"]["param"] == "stream_options"


async def test_a_streamed_chat_has_the_token_ids_and_stop_fields_of_the_whole(cluster):
    body = {"model": "default", "messages": [{"role": "user", "content": "Count to five."}],
            "temperature": 0, "max_tokens": 12, "logit_bias": {"42": 8},
            "extra_body": {"return_token_ids": True, "stop_token_ids": [42]}}  # fmt: skip
    async with openai_client(cluster.url) as c:
        whole = await c.chat.completions.create(**body)
        stream = await c.chat.completions.create(**body, stream=True)
        chunks = [chunk async for chunk in stream]
    prompt_ids = [ch.model_extra["prompt_token_ids"] for ch in chunks
                  if ch.model_extra.get("prompt_token_ids")]  # fmt: skip
    assert prompt_ids == [whole.model_extra["prompt_token_ids"]]  # the first chunk's only
    choices = [choice for ch in chunks for choice in ch.choices]
    streamed = [t for choice in choices for t in choice.model_extra.get("token_ids", [])]
    assert streamed == whole.choices[0].model_extra["token_ids"]
    last = chunks[-1].choices[0]
    assert last.finish_reason == whole.choices[0].finish_reason
    for key in ("stop_reason", "matched_stop"):
        assert last.model_extra[key] == whole.choices[0].model_extra[key]
