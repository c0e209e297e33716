"""The cluster and prompts that the constrained-decoding e2e modules share
(test_structured_output.py, test_tool_calling.py): two prefill workers, one decode worker
with room for a test's concurrent answers, the default model, nats-server.

Every prompt is long (a ~300-token system prompt behind a per-request tag), so the router
disaggregates it: the prefill worker samples the first token under the grammar and the
decode worker goes on from it.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import aiohttp
import jsonschema
import pytest

from tests.router.e2e_cluster import E2ECluster, metric, openai_client

RULES = " ".join(
    f"Rule {i}: answer with exactly the requested format and keep every value short."
    for i in range(20)
)
_tags = itertools.count()


def long_messages(ask: str) -> list[dict[str, str]]:
    """A chat whose prompt is past the router's disaggregation threshold (128 tokens) and
    shares no page with any other request's (the tag is in the first page)."""
    return [
        {"role": "system", "content": f"Session {next(_tags)}. {RULES}"},
        {"role": "user", "content": ask},
    ]


def long_prompt(ask: str) -> str:
    return f"Session {next(_tags)}. {RULES}\n{ask}\n"


def schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def schema_errors(text: str | None, schema: dict[str, Any]) -> str:
    """Why `text` is not a JSON value valid against `schema` ("" when it is)."""
    try:
        value = json.loads(text or "")
    except ValueError as e:
        return f"not JSON ({e}): {text!r}"
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]
    return f"{errors} in {text!r}" if errors else ""


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}  # fmt: skip

# -- the cluster ---------------------------------------------------------------------------


class StructuredCluster(E2ECluster):
    """E2ECluster with a decode KV pool that holds every concurrent answer of a test at once
    (the default 128 MB is ~2,800 tokens of the default model; a test sends ~16 x 400)."""

    decode_args = ("--kv-cache-mb", "512")


def structured_fixtures(logs: str):
    """The module-scoped `cluster` (a StructuredCluster, its logs under a temporary folder
    named `logs`) and the `c` fixture (an OpenAI client of it), for a module to assign."""

    @pytest.fixture(scope="module")
    def cluster(module_nats, tmp_path_factory):
        c = StructuredCluster(module_nats.url, tmp_path_factory.mktemp(logs), [])
        try:
            c.start()
            yield c
        finally:
            c.stop()

    @pytest.fixture
    async def c(cluster):
        async with openai_client(cluster.url) as client:
            yield client

    return cluster, c


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=body) as r:
        return r.status, await r.json()


async def prefill_routes(url: str) -> float:
    return await metric(url, "tandem:router_decisions_total", role="prefill")
