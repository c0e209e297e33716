"""/openapi.json stays true: its paths are the app's routes, its request schemas are the
validator's fields, and real responses of a router process match its response schemas
(completion and chat bodies are checked against real workers in test_router_e2e.py)."""

from __future__ import annotations

import aiohttp
import pytest

from services.router.api import app, openapi
from services.router.formats.openai.validation import (
    CHAT_SPECS,
    COMPLETION_SPECS,
    neutral_fields,
    parse_request,
)
from services.router.formats.responses.request import NEUTRAL, RESPONSES_SPECS, read_body
from tests.router.conftest import Routers
from tests.router.schema_check import check, response_schema

DOC = openapi.document("default")


def test_documented_paths_are_exactly_the_routes():
    routes = {(path, method.lower()) for method, path, _ in app.routes()}
    documented = {(path, method) for path, ops in DOC["paths"].items() for method in ops}
    assert routes == documented


@pytest.mark.parametrize(
    ("name", "endpoint", "specs"),
    [
        ("CompletionRequest", "completions", COMPLETION_SPECS),
        ("ChatCompletionRequest", "chat", CHAT_SPECS),
    ],
)
def test_request_schemas_list_every_accepted_field_and_no_other(name, endpoint, specs):
    schema = DOC["components"]["schemas"][name]
    assert set(schema["properties"]) == {s.name for s in specs} | set(neutral_fields(endpoint))
    assert set(schema["required"]) == {s.name for s in specs if s.required}
    assert schema["additionalProperties"] is False


def test_the_responses_schema_lists_every_accepted_field_and_no_other():
    schema = DOC["components"]["schemas"]["ResponseRequest"]
    assert set(schema["properties"]) == {s.name for s in RESPONSES_SPECS} | set(NEUTRAL)
    assert set(schema["required"]) == {s.name for s in RESPONSES_SPECS if s.required}
    assert schema["additionalProperties"] is False
    body = {"model": "m", "input": "x", "include": [], "truncation": "disabled"}
    read_body(body)  # what the parser accepts the document accepts
    assert not check(body, {"$ref": "#/components/schemas/ResponseRequest"}, DOC)
    refused = {**body, "truncation": "auto"}  # a neutral-only field at another value
    assert check(refused, {"$ref": "#/components/schemas/ResponseRequest"}, DOC)


def test_documented_bounds_are_the_enforced_bounds():
    schema = DOC["components"]["schemas"]["CompletionRequest"]["properties"]
    assert schema["temperature"]["maximum"] == 2 and schema["top_p"]["exclusiveMinimum"] == 0
    body = {"model": "m", "prompt": "x", "temperature": 2, "top_p": 1e-9, "logprobs": 20}
    parse_request("completions", body, max_n=1)  # the documented edges are accepted
    assert not check(body, {"$ref": "#/components/schemas/CompletionRequest"}, DOC)


@pytest.fixture(scope="module")
def router(module_nats, tmp_path_factory):
    routers = Routers(module_nats.url, tmp_path_factory.mktemp("router-logs"))
    try:
        yield routers.start("router-openapi")
    finally:
        routers.stop()


async def test_served_document_equals_the_module_and_real_responses_match_it(router):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{router}/openapi.json") as r:
            assert await r.json() == DOC
        async with http.get(f"{router}/v1/models") as r:
            body = await r.json()
            assert not check(body, response_schema(DOC, "/v1/models", "GET", 200), DOC)
        async with http.get(f"{router}/health") as r:
            body = await r.json()
            assert not check(body, response_schema(DOC, "/health", "GET", r.status), DOC)
        async with http.post(f"{router}/v1/completions", json={"model": "x", "prompt": 1}) as r:
            body = await r.json()
            schema = response_schema(DOC, "/v1/completions", "POST", r.status)
            assert r.status == 400 and not check(body, schema, DOC)
