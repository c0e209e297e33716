"""The pieces every path of /openapi.json is built from: a schema reference, a JSON
response, a POST operation (openapi.py, openapi_info.py, messages_openapi.py,
responses_openapi.py)."""

from __future__ import annotations

from typing import Any


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_response(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref(name)}}}


def post(
    request: str,
    response: str,
    summary: str,
    ok: str,
    errors: dict[str, Any],
    stream: str | None = None,
) -> dict[str, Any]:
    """A POST taking the `request` schema, answering `response` (described by `ok`; also
    an event stream, described by `stream`, when given) or one of `errors`."""
    answer = json_response(response, ok)
    if stream is not None:
        answer["content"]["text/event-stream"] = {
            "schema": {"type": "string", "description": stream}
        }
    body = {"required": True, "content": {"application/json": {"schema": ref(request)}}}
    return {
        "post": {"summary": summary, "requestBody": body, "responses": {"200": answer, **errors}}
    }
