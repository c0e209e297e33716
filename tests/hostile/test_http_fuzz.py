"""The HTTP API fuzzed from its own OpenAPI document (schemathesis): every generated body,
valid or not, gets a 2xx that matches the document or a 4xx with an OpenAI error body
(Anthropic's on /v1/messages);
never a 5xx, and the workers behind the router still serve afterwards.

Positive cases (bodies the document allows) reach the real workers: their `model` is set
to the served one and generation is capped at 2 tokens so a case takes well under a second.
Negative cases (bodies the document forbids: wrong types, out-of-range numbers, missing
fields, non-JSON bytes) must all be refused with a 4xx. Bounded: a fixed number of
examples per endpoint and mode, no shrinking, the same examples every run (derandomized).
"""

from __future__ import annotations

import collections

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from services.router.api import openapi
from tests.hostile.conftest import Hostile
from tests.router.schema_check import check, response_schema

pytestmark = pytest.mark.slow

DOC = openapi.document("default")
SCHEMA = schemathesis.openapi.from_dict(DOC)
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 100}
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# How a stream of each endpoint ends: OpenAI's chat and completions with [DONE]; the
# Responses API with its terminal event (and no [DONE]).
STREAM_ENDS = {
    "/v1/responses": ("response.completed", "response.incomplete", "response.failed"),
    "/v1/messages": ("message_stop", "error"),
}


def _bounded(body: object, positive: bool, path: str) -> object:
    """Keep every case cheap: at most 2 generated tokens and 2 choices (a valid chat request
    without max_tokens would otherwise generate up to the context length). Only the
    endpoint's own fields are set: any other is refused."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if positive:
        body["model"] = "default"
        if isinstance(body.get("n"), int):
            body["n"] = min(body["n"], 2)
    limits = {
        "/v1/responses": ("max_output_tokens",),
        "/v1/completions": ("max_tokens",),
        "/v1/messages": ("max_tokens",),
    }.get(path, ("max_tokens", "max_completion_tokens"))
    for name in limits:
        value = body.get(name)
        if name not in body or (isinstance(value, int) and not isinstance(value, bool)
                                and value > 2):  # fmt: skip
            body[name] = 2
    return body


def problems_of(response: requests.Response, path: str, positive: bool) -> list[str]:
    """What is wrong with one answer; empty when it is acceptable."""
    status, out = response.status_code, []
    if status >= 500:
        out.append(f"server error {status}: {response.text[:300]}")
    if not positive and status < 400:
        out.append(f"a body the document forbids was accepted ({status})")
    if status >= 400:
        try:
            body = response.json()
            error = body["error"]
            if path == "/v1/messages":  # Anthropic's shape
                assert body["type"] == "error" and set(error) == {"type", "message"}
            else:
                assert set(error) == {"message", "type", "param", "code"}
            assert isinstance(error["message"], str) and isinstance(error["type"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            out.append(f"{status} without its API's error body: {response.text[:300]}")
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        ends = STREAM_ENDS.get(path)
        if ends is None and not response.text.rstrip().endswith("data: [DONE]"):
            out.append(f"stream without [DONE]: {response.text[-300:]}")
        last = response.text.rstrip().rsplit("\n\n", 1)[-1]
        if ends is not None and not any(f"event: {end}\n" in last for end in ends):
            out.append(f"stream without its terminal event: {response.text[-300:]}")
    else:
        schema = response_schema(DOC, path, "POST", 200)
        out += check(response.json(), schema, DOC)
    if "Traceback" in response.text:
        out.append("a traceback in the response")
    return out


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzzed_bodies_get_2xx_or_openai_4xx_never_5xx(hostile: Hostile, path, mode):
    positive = mode is GenerationMode.POSITIVE
    statuses: collections.Counter[int] = collections.Counter()
    failures: list[str] = []
    session = requests.Session()

    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              phases=[p for p in settings.default.phases if p.name != "shrink"],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(SCHEMA[path]["POST"].as_strategy(generation_mode=mode))
    def fuzz(case):
        case.body = _bounded(case.body, positive, path)
        headers = {**hostile.headers, **(case.headers or {})}
        # requests, not case.call(): schemathesis stops reading an SSE stream after a few
        # events, and a stream must be read to its end to check it ends with [DONE].
        kwargs = case.as_transport_kwargs(base_url=hostile.url, headers=headers)
        response = session.request(**kwargs, timeout=60)
        statuses[response.status_code] += 1
        for problem in problems_of(response, path, positive):
            failures.append(f"{problem}\n  body: {repr(case.body)[:300]}")

    fuzz()
    print(f"fuzz {path} {mode.value}: {sum(statuses.values())} inputs, {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    assert not hostile.dead(), f"exited: {hostile.dead()}"
    if positive:
        assert statuses[200] > 0, "no generated case reached the workers"


async def test_workers_still_serve_after_the_fuzzing(hostile: Hostile):
    assert not hostile.dead()
    await hostile.completion_works()
