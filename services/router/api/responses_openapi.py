"""/openapi.json's part for the Responses API's stored responses (requests/responses.py):
GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, and the response
object's schemas (POST /v1/responses itself is rendered from its field table in
openapi.py, like chat). Merged into the document by openapi.py, as pins.py's part is."""

from __future__ import annotations

from typing import Any

from services.router.api.openapi_parts import json_response

_STR, _INT = {"type": "string"}, {"type": "integer"}
_NULL_STR = {"type": ["string", "null"]}


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


_ITEM = _obj(["id", "type"], id=_STR, type={"enum": ["message", "function_call",
                                                     "function_call_output"]})  # fmt: skip
SCHEMAS: dict[str, Any] = {
    "Response": _obj(
        ["id", "object", "created_at", "status", "model", "output"],
        id=_STR,
        object={"const": "response"},
        created_at=_INT,
        status={"enum": ["completed", "incomplete", "in_progress", "failed"]},
        model=_STR,
        output={"type": "array", "items": _ITEM},
        usage=_obj(
            ["input_tokens", "input_tokens_details", "output_tokens", "total_tokens"],
            input_tokens=_INT,
            input_tokens_details=_obj(["cached_tokens"], cached_tokens=_INT),
            output_tokens=_INT,
            total_tokens=_INT,
        ),
    ),
    "ResponseDeleted": _obj(
        ["id", "object", "deleted"],
        id=_STR,
        object={"const": "response"},
        deleted={"const": True},
    ),
    "ResponseItemList": _obj(
        ["object", "data", "has_more", "first_id", "last_id"],
        object={"const": "list"},
        data={"type": "array", "items": _ITEM},
        has_more={"type": "boolean"},
        first_id=_NULL_STR,
        last_id=_NULL_STR,
    ),
}
_ID = {"name": "response_id", "in": "path", "required": True, "schema": _STR}
_QUERY = [
    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}},
    {"name": "limit", "in": "query",
     "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
    {"name": "after", "in": "query", "schema": _STR},
]  # fmt: skip


def _errors(*extra: tuple[str, str]) -> dict[str, Any]:
    pairs = (("401", "missing or wrong API key (when the router has keys)"),
             ("404", "no stored response of this id (never stored, expired, deleted)"),
             ("503", "stored responses unreachable (JetStream)"), *extra)  # fmt: skip
    return {code: json_response("Error", text) for code, text in pairs}


PATHS: dict[str, Any] = {
    "/v1/responses/{response_id}": {
        "get": {
            "summary": "A stored response",
            "parameters": [_ID],
            "responses": {"200": json_response("Response", "the response object"), **_errors()},
        },
        "delete": {
            "summary": "Delete a stored response",
            "parameters": [_ID],
            "responses": {"200": json_response("ResponseDeleted", "deleted"), **_errors()},
        },
    },
    "/v1/responses/{response_id}/input_items": {
        "get": {
            "summary": "A stored response's input items, a page at a time",
            "parameters": [_ID, *_QUERY],
            "responses": {
                "200": json_response("ResponseItemList", "a page of items"),
                **_errors(("400", "a bad order, limit or after")),
            },
        },
    },
}
