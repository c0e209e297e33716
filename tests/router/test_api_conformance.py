"""Every request field of vLLM's ChatCompletionRequest and CompletionRequest is either in
our table, with a test that shows its effect through a real disaggregated cluster (here,
in EFFECTS, or a named test elsewhere, in POINTERS), or refused with a 400 naming it.

The field lists are vLLM's, copied by name from vllm/entrypoints/openai/protocol.py at
vllm-project/vllm commit ec3b890c14b00f6670515d9df8d503b5270e95ca (the classes'
declared fields, in their order). vLLM's older `guided_*` names are no longer fields
there; tests/router/test_request_fields.py checks them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.router.formats.openai.validation import CHAT_SPECS, COMPLETION_SPECS
from tests.router.e2e_cluster import cluster_fixture

VLLM_COMMIT = "ec3b890c14b00f6670515d9df8d503b5270e95ca"
VLLM_CHAT = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice",
    "reasoning_effort", "include_reasoning", "parallel_tool_calls", "user", "use_beam_search",
    "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
    "cache_salt", "kv_transfer_params", "vllm_xargs",
)  # fmt: skip
VLLM_COMPLETION = (
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "prompt_embeds",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs",
)  # fmt: skip
VLLM_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
ENDPOINTS = {"chat": (VLLM_CHAT, CHAT_SPECS), "completions": (VLLM_COMPLETION, COMPLETION_SPECS)}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

# A value for each field that is not its neutral one: what a refusal is tested with.
VALUES: dict[str, Any] = {
    "logit_bias": {"1": 5}, "min_tokens": 2, "prompt_logprobs": 1, "return_token_ids": True,
    "cache_salt": "salt-a", "reasoning_effort": "low", "include_reasoning": False,
    "use_beam_search": True, "length_penalty": 0.5, "include_stop_str_in_output": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4, "allowed_token_ids": [1, 2], "bad_words": ["Paris"],
    "echo": True, "add_special_tokens": True, "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}", "mm_processor_kwargs": {"a": 1}, "priority": 1,
    "request_id": "mine", "logits_processors": ["a.b"], "return_tokens_as_token_ids": True,
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "suffix": "end",
    "prompt_embeds": "AAAA",
}  # fmt: skip

# Accepted fields whose effect another test shows (file::test, checked to exist below).
POINTERS = {
    **dict.fromkeys(
        ("presence_penalty", "frequency_penalty", "repetition_penalty"),
        "tests/engine/model/test_sampler.py::test_penalties_push_seen_tokens_down",
    ),
    "echo": "tests/router/test_router_e2e.py::test_echo_prepends_the_prompt",
    "response_format": "tests/router/test_structured_output.py::"
    "test_every_generated_schema_is_followed_and_ends_with_stop",
    "tools": "tests/router/test_tool_calling.py::test_tools_required_gives_valid_tool_calls",
    "tool_choice": "tests/router/test_tool_calling.py::"
    "test_tools_named_choice_calls_that_function_with_valid_arguments",
    "parallel_tool_calls": "tests/router/test_tool_calling.py::"
    "test_tools_required_without_parallel_calls_gives_exactly_one",
    "top_logprobs": "tests/router/test_router_e2e.py::"
    "test_chat_sync_and_stream_with_logprobs_n_and_stop",
    # Salt B gets 0 cached tokens of salt A's prompt, through PD and the pool.
    "cache_salt": "tests/router/test_router_cache_salt_cluster.py::"
    "test_salt_b_gets_no_cached_token_of_a_prompt_salt_a_cached",
    # Lower first within a tenant's queue (issue 39).
    "priority": "tests/router/test_tenants_cluster.py::test_priority_orders_a_tenants_queue",
    # The default model's template reads no extra variable; a thinking model's does.
    "chat_template_kwargs": "tests/router/test_reasoning_e2e.py::"
    "test_enable_thinking_false_closes_the_thinking_in_the_prompt_and_splits_nothing",
}
REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

cluster = cluster_fixture("conformance-logs", ["--disagg-threshold", "0"])  # every prompt PD


class Api:
    """Raw HTTP on the cluster's router; `ask` returns (status, JSON body)."""

    def __init__(self, url: str, http: aiohttp.ClientSession, logs: Path):
        self.url, self.http, self.logs = url, http, logs

    async def ask(self, endpoint: str, **body: Any) -> tuple[int, dict]:
        base: dict[str, Any] = {"model": "default", "temperature": 0, "max_tokens": 8}
        base |= {"messages": MESSAGES} if endpoint == "chat" else {"prompt": PROMPT}
        async with self.http.post(self.url + PATHS[endpoint], json=base | body) as r:
            if r.content_type == "text/event-stream":
                return r.status, {"events": (await r.text()).split("\n\n")}
            return r.status, await r.json()

    async def ok(self, endpoint: str, **body: Any) -> dict:
        status, out = await self.ask(endpoint, **body)
        assert status == 200, out
        return out

    async def text(self, endpoint: str, **body: Any) -> str:
        choice = (await self.ok(endpoint, **body))["choices"][0]
        return choice["message"]["content"] if endpoint == "chat" else choice["text"]

    async def tokens(self, **body: Any) -> int:
        async with self.http.post(self.url + "/tokenize", json=body) as r:
            return (await r.json())["count"]


@pytest.fixture
async def api(cluster):
    async with aiohttp.ClientSession() as http:
        yield Api(cluster.url, http, cluster.logs)


# --- effects: one small check per accepted field, on both endpoints where it is -------------

Effect = Callable[[Api, str], Awaitable[None]]
HOT = {"temperature": 2.0, "seed": 11, "max_tokens": 12}


async def _model(api: Api, e: str) -> None:
    status, out = await api.ask(e, model="no-such-model")
    assert status == 404 and out["error"]["code"] == "model_not_found"


async def _prompt(api: Api, e: str) -> None:
    out = await api.ok(e)
    sent = {"messages": MESSAGES} if e == "chat" else {"prompt": PROMPT}
    assert out["usage"]["prompt_tokens"] == await api.tokens(**sent)


async def _max_tokens(api: Api, e: str) -> None:
    out = await api.ok(e, max_tokens=3, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 3


async def _max_completion_tokens(api: Api, e: str) -> None:
    out = await api.ok(e, max_tokens=None, max_completion_tokens=2, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 2


async def _n(api: Api, e: str) -> None:
    assert len((await api.ok(e, n=2, max_tokens=2))["choices"]) == 2


async def _stream(api: Api, e: str) -> None:
    events = (await api.ok(e, stream=True))["events"]
    assert events[0].startswith("data: {") and "data: [DONE]" in events


async def _stream_options(api: Api, e: str) -> None:
    events = (await api.ok(e, stream=True, stream_options={"include_usage": True}))["events"]
    assert any('"completion_tokens"' in ev for ev in events)


async def _temperature(api: Api, e: str) -> None:
    greedy = await api.text(e, max_tokens=12)
    hot = [await api.text(e, **HOT | {"seed": s}) for s in (11, 12)]
    assert any(h != greedy for h in hot)


async def _cut_to_greedy(api: Api, e: str, **field: Any) -> None:
    """At temperature 2, `field` keeps only the likeliest token: the greedy text (the
    default repetition penalty, which greedy requests go without, set off)."""
    hot = await api.text(e, **HOT, **field, repetition_penalty=1.0)
    assert hot == await api.text(e, max_tokens=12)


async def _seed(api: Api, e: str) -> None:
    one = await api.text(e, **HOT)
    assert await api.text(e, **HOT) == one
    assert any([await api.text(e, **HOT | {"seed": s}) != one for s in (1, 2, 3)])


async def _stop(api: Api, e: str) -> None:
    greedy = await api.text(e, max_tokens=12, ignore_eos=True)
    word = next(w for w in greedy.split() if greedy.index(w) > 0)
    out = await api.ok(e, max_tokens=12, ignore_eos=True, stop=[word])
    choice = out["choices"][0]
    text = choice["message"]["content"] if e == "chat" else choice["text"]
    assert choice["finish_reason"] == "stop" and text == greedy[: greedy.index(word)]


async def _stop_token_ids(api: Api, e: str) -> None:
    first = await api.text(e, max_tokens=1)
    async with api.http.post(
        api.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}
    ) as r:
        (token,) = (await r.json())["tokens"]  # fmt: skip
    out = await api.ok(e, stop_token_ids=[token], ignore_eos=False)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] <= 1


async def _ignore_eos(api: Api, e: str) -> None:
    out = await api.ok(e, max_tokens=40, ignore_eos=True)
    assert (
        out["usage"]["completion_tokens"] == 40 and out["choices"][0]["finish_reason"] == "length"
    )


async def _user(api: Api, e: str) -> None:
    user = f"end-user-{e}-{time.monotonic_ns()}"  # logged by the router, with the request
    await api.ok(e, user=user)
    logged = (api.logs / "router.log").read_text().splitlines()
    assert any(f'"user": "{user}"' in line and "request_id" in line for line in logged)
    status, out = await api.ask(e, user=5)
    assert status == 400 and out["error"]["param"] == "user"


async def _logprobs(api: Api, e: str) -> None:
    if e == "chat":
        out = await api.ok(e, logprobs=True, top_logprobs=2)
        tops = out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    else:
        out = await api.ok(e, logprobs=2)
        tops = out["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(tops) == 2


async def _grammar(api: Api, e: str, **field: Any) -> None:
    text = await api.text(e, max_tokens=12, **field)
    assert re.fullmatch(r"[0-9]{3}|yes|no", text), text


async def _template_field(api: Api, e: str, **field: Any) -> None:
    """The prompt the workers ran is the one /tokenize renders with the field, not the
    one without it."""
    messages = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    out = await api.ok(e, messages=messages, **field)
    expected = await api.tokens(messages=messages, **field)
    assert out["usage"]["prompt_tokens"] == expected != await api.tokens(messages=messages)


async def _logit_bias(api: Api, e: str) -> None:
    out = await api.ok(e, max_tokens=3, logit_bias={"42": 100}, return_token_ids=True)
    assert out["choices"][0]["token_ids"] == [42, 42, 42]  # token 0 at the prefill worker


async def _min_tokens(api: Api, e: str) -> None:
    body = {"logit_bias": {"42": 100}, "stop_token_ids": [42], "return_token_ids": True}
    out = await api.ok(e, **body, min_tokens=2)
    ids, choice = out["choices"][0]["token_ids"], out["choices"][0]
    assert len(ids) == 3 and 42 not in ids[:2] and choice["stop_reason"] == 42
    assert (await api.ok(e, **body))["choices"][0]["token_ids"] == [42]


async def _prompt_logprobs(api: Api, e: str) -> None:
    out = await api.ok(e, prompt_logprobs=1, max_tokens=1)
    scored = out["prompt_logprobs"] if e == "chat" else out["choices"][0]["prompt_logprobs"]
    assert len(scored) == out["usage"]["prompt_tokens"] and scored[0] is None
    assert all(1 <= len(entry) <= 2 for entry in scored[1:])


async def _return_token_ids(api: Api, e: str) -> None:
    out = await api.ok(e, return_token_ids=True)
    prompt_ids = out["prompt_token_ids"] if e == "chat" else out["choices"][0]["prompt_token_ids"]
    assert len(out["choices"][0]["token_ids"]) == out["usage"]["completion_tokens"]
    assert len(prompt_ids) == out["usage"]["prompt_tokens"]


EFFECTS: dict[str, Effect] = {
    "model": _model, "prompt": _prompt, "messages": _prompt, "max_tokens": _max_tokens,
    "max_completion_tokens": _max_completion_tokens, "n": _n, "stream": _stream,
    "stream_options": _stream_options, "temperature": _temperature,
    "top_k": lambda a, e: _cut_to_greedy(a, e, top_k=1),
    "top_p": lambda a, e: _cut_to_greedy(a, e, top_p=1e-9),
    "min_p": lambda a, e: _cut_to_greedy(a, e, min_p=1.0),
    "seed": _seed, "stop": _stop, "stop_token_ids": _stop_token_ids, "ignore_eos": _ignore_eos,
    "user": _user, "logprobs": _logprobs,
    "structured_outputs": lambda a, e: _grammar(a, e, structured_outputs={"choice": ["yes", "no"]}),
    "add_generation_prompt": lambda a, e: _template_field(a, e, add_generation_prompt=False),
    "continue_final_message": lambda a, e: _template_field(
        a, e, continue_final_message=True, add_generation_prompt=False
    ),
    "logit_bias": _logit_bias, "min_tokens": _min_tokens, "prompt_logprobs": _prompt_logprobs,
    "return_token_ids": _return_token_ids,
}  # fmt: skip


def _accepted(endpoint: str) -> set[str]:
    return {s.name for s in ENDPOINTS[endpoint][1]}


def _cases(kind: str) -> list[tuple[str, str]]:
    out = []
    for endpoint, (fields, _) in ENDPOINTS.items():
        for name in fields:
            accepted = name in _accepted(endpoint)
            if kind == "effect" and accepted and name in EFFECTS:
                out.append((endpoint, name))
            if kind == "refused" and not accepted:
                out.append((endpoint, name))
    return out


@pytest.mark.parametrize(
    ("endpoint", "name"), [(e, n) for e, (f, _) in ENDPOINTS.items() for n in f]
)
def test_every_vllm_field_is_accounted_for(endpoint, name):
    """In our table: an effect here or a pointer; otherwise refused (with a value to send)."""
    if name in _accepted(endpoint):
        assert name in EFFECTS or name in POINTERS, f"{name}: accepted without an effect test"
    else:
        assert name in VALUES, f"{name}: refused, but no value to send it with"


@pytest.mark.parametrize("name", sorted(POINTERS))
def test_each_pointer_names_a_test_that_exists(name):
    path, test = POINTERS[name].split("::")
    assert re.search(rf"^(async )?def {test}\(", (REPO / path).read_text(), re.M), POINTERS[name]


@pytest.mark.parametrize(("endpoint", "name"), _cases("refused"))
async def test_a_field_outside_our_table_is_refused_naming_it(api, endpoint, name):
    status, out = await api.ask(endpoint, **{name: VALUES[name]})
    assert status == 400 and out["error"]["param"] == name, out
    assert name in out["error"]["message"]


@pytest.mark.parametrize(("endpoint", "name"), _cases("effect"))
async def test_an_accepted_field_has_its_effect(api, endpoint, name):
    await EFFECTS[name](api, endpoint)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize("key", [*VLLM_STREAM_OPTIONS, "no_such_option"])
async def test_each_vllm_stream_option_is_honoured_or_refused(api, endpoint, key):
    options = {"include_usage": True, key: True}
    status, out = await api.ask(endpoint, stream=True, stream_options=options)
    if key == "include_usage":
        assert status == 200 and any('"usage"' in ev for ev in out["events"])
    elif key == "continuous_usage_stats":  # usage in every chunk
        chunks = [ev for ev in out["events"] if ev.startswith("data: {")]
        assert status == 200 and chunks and all('"usage":{' in ev for ev in chunks), out
    else:  # an option we do not have: refused, naming it
        assert status == 400 and out["error"]["param"] == f"stream_options.{key}", out
