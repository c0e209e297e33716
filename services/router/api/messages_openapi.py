"""/openapi.json's part for Anthropic's Messages API (requests/messages.py): the schemas of
its request fields' kinds (the field tables themselves are formats/anthropic/request.py's,
rendered by openapi.py like chat's), the message and its errors, and the two paths.

Each kind's schema admits every value the parser accepts (null where it reads null as
absent) and as little else as JSON Schema can say: what it cannot say (a prefill's rules,
a tool_choice naming one of the tools) is refused by the parser with a 400.
"""

from __future__ import annotations

from typing import Any

from libs.common.engine.core.sampling_params import MAX_STOP, MAX_STOP_CHARS
from services.router.api.openapi_parts import json_response, post

_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_NULL_STR = {"type": ["string", "null"]}
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}


def _closed(required: list[str], **props: Any) -> dict[str, Any]:
    """An object with exactly these properties (`required` among them)."""
    return {
        "type": "object",
        "required": required,
        "properties": props,
        "additionalProperties": False,
    }


_CACHE = _closed(["type"], type={"const": "ephemeral"}, ttl={"enum": ["5m", "1h"]})
_CACHE_OR_NULL = {"oneOf": [{"type": "null"}, _CACHE]}
_TEXT = _closed(
    ["type", "text"],
    type={"const": "text"},
    text=_STR,
    cache_control=_CACHE_OR_NULL,
    citations={"oneOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
)
_TEXTS = {"type": "array", "items": _TEXT}
_STRING_OR_TEXTS = {"oneOf": [_STR, _TEXTS]}
_TOOL_USE = _closed(
    ["type", "id", "name", "input"],
    type={"const": "tool_use"},
    id=_STR,
    name=_STR,
    input={"type": "object"},
    cache_control=_CACHE_OR_NULL,
)
_TOOL_RESULT = _closed(
    ["type", "tool_use_id"],
    type={"const": "tool_result"},
    tool_use_id=_STR,
    content=_STRING_OR_TEXTS,
    is_error=_BOOL,
    cache_control=_CACHE_OR_NULL,
)
_THINKING = _closed(["type", "thinking"], type={"const": "thinking"}, thinking=_STR,
                    signature=_STR)  # fmt: skip
_REDACTED = _closed(["type", "data"], type={"const": "redacted_thinking"}, data=_STR)


def _turn(role: str, *blocks: dict[str, Any]) -> dict[str, Any]:
    content = {"oneOf": [_STR, {"type": "array", "items": {"oneOf": list(blocks)}}]}
    return _closed(["role", "content"], role={"const": role}, content=content)


_TOOL = _closed(
    ["name", "input_schema"],
    name={"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
    description=_NULL_STR,
    input_schema={"type": "object", "required": ["type"], "properties": {"type": {"const":
                                                                                 "object"}}},
    cache_control=_CACHE_OR_NULL,
    type={"enum": ["custom", None]},
    strict=_BOOL,
)  # fmt: skip
_PARALLEL = {"disable_parallel_tool_use": _BOOL}
KINDS: dict[str, dict[str, Any]] = {
    "strings": {"type": "array", "items": _STOP, "maxItems": MAX_STOP},
    "system": _STRING_OR_TEXTS,
    "anthropic_messages": {
        "type": "array",
        "minItems": 1,
        "items": {
            "oneOf": [
                _turn("user", _TEXT, _TOOL_RESULT),
                _turn("assistant", _TEXT, _TOOL_USE, _THINKING, _REDACTED),
                _closed(["role", "content"], role={"const": "system"}, content=_STRING_OR_TEXTS),
            ]
        },
    },
    "anthropic_tools": {"type": "array", "items": _TOOL},
    "anthropic_tool_choice": {
        "oneOf": [
            _closed(["type"], type={"enum": ["auto", "any"]}, **_PARALLEL),
            _closed(["type", "name"], type={"const": "tool"}, name=_STR, **_PARALLEL),
            _closed(["type"], type={"const": "none"}),
        ]
    },
    "cache_control": _CACHE,
    "thinking": _closed(["type"], type={"enum": ["disabled", "adaptive"]}),
    "metadata": _closed([], user_id=_NULL_STR),
    "output_config": _closed(
        [],
        format={
            "oneOf": [
                {"type": "null"},
                _closed(["type", "schema"], type={"const": "json_schema"}, schema={}),
            ]
        },
        effort={"type": "null"},
    ),
}
_USAGE = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
SCHEMAS: dict[str, Any] = {
    "Message": _closed(
        ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        id=_STR,
        type={"const": "message"},
        role={"const": "assistant"},
        model=_STR,
        content={
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["thinking", "text", "tool_use"]}},
            },
        },
        stop_reason={"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        stop_sequence=_NULL_STR,
        usage=_closed(
            list(_USAGE),
            **dict.fromkeys(_USAGE, _INT),
        ),
    ),
    "MessageTokens": _closed(["input_tokens"], input_tokens=_INT),
    "AnthropicError": _closed(
        ["type", "error"],
        type={"const": "error"},
        error=_closed(["type", "message"], type=_STR, message=_STR),
    ),
}


def _post(request: str, response: str, summary: str, stream: bool, errors: dict) -> dict:
    shaped = {code: json_response("AnthropicError", text) for code, text in errors.items()}
    events = "Anthropic's events (stream: true)" if stream else None
    return post(request, response, summary, summary, shaped, events)


def paths(errors: dict[str, str]) -> dict[str, Any]:
    """The two paths; `errors`: status -> description, as the other paths have them (their
    bodies here in Anthropic's shape)."""
    return {
        "/v1/messages": _post("MessagesRequest", "Message", "Anthropic's Messages API", True,
                              errors),
        "/v1/messages/count_tokens": _post(
            "CountTokensRequest", "MessageTokens", "The prompt's tokens (not run)", False, errors
        ),
    }  # fmt: skip
