"""Hand-written hostile HTTP requests against a router with real workers: each gets a 4xx
with an OpenAI error body naming the problem (or a correct 200 where the input is odd but
valid), never a 5xx, and the workers serve afterwards."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.hostile.conftest import Hostile

VOCAB = 49152  # the default model's vocabulary
COMP, CHAT = "/v1/completions", "/v1/chat/completions"


def _body(**fields) -> bytes:
    return json.dumps({"model": "default", "prompt": "hi", "max_tokens": 1, **fields}).encode()


def _deep(n: int) -> str:
    return "[" * n + "]" * n


# (name, path, raw body, expected status, expected `param` or None)
CASES = [
    ("body over 16 MiB", COMP, b'{"prompt": "' + b"a" * (17 << 20) + b'"}', 413, None),
    ("100k-deep JSON", COMP, f'{{"model": "default", "prompt": {_deep(100_000)}}}'.encode(),
     400, None),
    ("invalid UTF-8", COMP, b'{"model": "default", "prompt": "\xff\xfe\xc3\x28"}', 400, None),
    ("lone surrogate", COMP, b'{"model": "default", "prompt": "\\ud800 hi"}', 400, None),
    ("NUL bytes only", COMP, b"\x00" * 64, 400, None),
    ("max_tokens -5", COMP, _body(max_tokens=-5), 400, "max_tokens"),
    ("n -1", COMP, _body(n=-1), 400, "n"),
    ("seed -1", COMP, _body(seed=-1), 400, "seed"),
    ("top_k -100", COMP, _body(top_k=-100), 400, "top_k"),
    ("temperature -1e308", COMP, _body(temperature=-1e308), 400, "temperature"),
    ("max_tokens 10**400", COMP, b'{"model": "default", "prompt": "hi", "max_tokens": 1'
     + b"0" * 400 + b"}", 400, None),
    ("temperature 1e400", COMP, b'{"model": "default", "prompt": "hi", "temperature": 1e400}',
     400, None),
    ("seed 2**64", COMP, _body(seed=2**64), 400, "seed"),
    ("max_tokens 2**62", COMP, _body(max_tokens=2**62), 400, None),
    ("logprobs 2**40", COMP, _body(logprobs=2**40), 400, "logprobs"),
    ("n 2**31", COMP, _body(n=2**31), 400, "n"),
    ("token id = vocab size", COMP, _body(prompt=[1, VOCAB]), 400, "prompt"),
    ("token id 2**31-1", COMP, _body(prompt=[2**31 - 1]), 400, "prompt"),
    ("token id 2**31", COMP, _body(prompt=[2**31]), 400, "prompt"),
    ("token id -1", COMP, _body(prompt=[5, -1]), 400, "prompt"),
    ("out of vocab in a batch", COMP, _body(prompt=[[1, 2], [VOCAB + 7]]), 400, "prompt"),
    ("out of vocab, streamed", COMP, _body(prompt=[VOCAB], stream=True), 400, "prompt"),
    ("100k-char stop string", COMP, _body(stop="x" * 100_000), 400, "stop"),
    ("16 x 100k-char stop strings", COMP, _body(stop=["x" * 100_000] * 16), 400, "stop"),
    ("200k stop token ids", COMP, _body(stop_token_ids=list(range(200_000))), 400,
     "stop_token_ids"),
    ("2000 prompts", COMP, _body(prompt=[[1] * 10] * 2000), 400, "prompt"),
    ("5000 string prompts", COMP, _body(prompt=["a"] * 5000), 400, "prompt"),
    ("prompt of 1M tokens", COMP, _body(prompt=[1] * 1_000_000), 400, None),
    ("prompt past the workers' KV pool", COMP, _body(prompt=[1] * 3000), 400, None),
    ("model is a list", COMP, json.dumps({"model": ["default"], "prompt": "hi"}).encode(), 400,
     "model"),
    ("prompt is an object", COMP, _body(prompt={"a": 1}), 400, "prompt"),
    ("stop id out of vocab", COMP, _body(stop_token_ids=[2**31 - 1]), 400, "stop_token_ids"),
    ("stream is a string", COMP, _body(stream="yes"), 400, "stream"),
    ("messages is a string", CHAT, json.dumps({"model": "default", "messages": "hi"}).encode(),
     400, "messages"),
    ("content is a number", CHAT, json.dumps({"model": "default", "messages": [
        {"role": "user", "content": 5}]}).encode(), 400, "messages"),
    ("300k-word message", CHAT, json.dumps({"model": "default", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi " * 300_000}]}).encode(), 400, None),
    ("20k messages", CHAT, json.dumps({"model": "default", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}] * 20_000}).encode(), 400, None),
    # Odd but valid: served, with a correct body.
    ("16 stop strings of 4096 chars", COMP, _body(stop=["x" * 4096] * 16), 200, None),
    ("NUL in the prompt", COMP, _body(prompt="a\u0000b"), 200, None),
    ("1 MB user field", COMP, _body(user="u" * 1_000_000), 200, None),
]  # fmt: skip


@pytest.mark.slow
async def test_hostile_requests_get_openai_4xx_and_the_workers_keep_serving(hostile: Hostile):
    failures = []
    headers = {**hostile.headers, "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for name, path, raw, status, param in CASES:
            async with http.post(f"{hostile.url}{path}", data=raw) as r:
                text = await r.text()
            problem = _problem(r.status, text, status, param)
            if problem:
                failures.append(f"{name}: {problem}")
    print(f"http hand-written: {len(CASES)} inputs, {len(failures)} failures")
    assert not failures, "\n".join(failures)
    assert not hostile.dead(), f"exited: {hostile.dead()}"
    await hostile.completion_works()


def _problem(status: int, text: str, want: int, param: str | None) -> str:
    if status != want:
        return f"status {status}, expected {want}: {text[:200]}"
    if "Traceback" in text:
        return "a traceback in the response"
    body = json.loads(text)
    if status == 200:
        return "" if body["choices"] and body["usage"]["completion_tokens"] >= 0 else text
    error = body.get("error", {})
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"not an OpenAI error body: {text[:200]}"
    if param is not None and error["param"] != param:
        return f"param {error['param']!r}, expected {param!r}: {error['message']}"
    return ""


@pytest.mark.slow
async def test_requests_without_the_api_key_are_401(hostile: Hostile):
    """Every request without a valid key that reaches the router gets 401 (OpenAI body,
    code invalid_api_key, WWW-Authenticate); the right key, as a control, gets 200."""
    key = hostile.headers["Authorization"][len("Bearer ") :]
    near = key[:-1] + ("x" if key[-1] != "x" else "y")
    cases = {
        "no header": {},
        "wrong key": {"Authorization": "Bearer wrong"},
        "basic scheme": {"Authorization": "Basic x"},
        "the key under another scheme": {"Authorization": f"Token {key}"},
        "the key with its last character changed": {"Authorization": f"Bearer {near}"},
        "the key with a suffix": {"Authorization": f"Bearer {key}x"},
        "empty bearer": {"Authorization": "Bearer "},
        "8000-char key": {"Authorization": "Bearer " + "k" * 8000},  # under aiohttp's 8190
    }
    got = {}
    async with aiohttp.ClientSession() as http:
        for name, auth in cases.items():
            async with http.post(f"{hostile.url}{COMP}", data=_body(), headers=auth) as r:
                body = await r.json(content_type=None) if r.status == 401 else await r.text()
                got[name] = (r.status, r.headers.get("WWW-Authenticate"),
                             body["error"]["code"] if r.status == 401 else body[:120])  # fmt: skip
        async with http.post(f"{hostile.url}{COMP}", data=_body(), headers=hostile.headers) as r:
            control = r.status
    wrong = {name: g for name, g in got.items() if g != (401, "Bearer", "invalid_api_key")}
    assert not wrong, wrong
    assert control == 200


@pytest.mark.slow
async def test_an_authorization_header_past_max_header_bytes_is_431_with_an_error_body(
    hostile: Hostile,
):
    """A 100k-char header is refused before aiohttp parses it (--max-header-bytes, 32 KiB
    by default: services/router/api/connections.py) with a 431 in OpenAI's shape."""
    auth = {"Authorization": "Bearer " + "k" * 100_000}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{hostile.url}{COMP}", data=_body(), headers=auth) as r:
            status, text = r.status, await r.text()
    assert status == 431, (status, text[:200])
    error = json.loads(text)["error"]
    assert "--max-header-bytes" in error["message"] and error["code"], error
    assert "invalid_api_key" not in text and "Traceback" not in text
    assert not hostile.dead(), f"exited: {hostile.dead()}"
