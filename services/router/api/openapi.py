"""/openapi.json: the router's API as an OpenAPI 3.1 document.

Request schemas are rendered from the same `Spec` tables the validator enforces
(validation.py), so the document cannot drift from what the parser accepts;
tests/router/test_openapi.py checks routes and real responses against it.
"""

from __future__ import annotations

from typing import Any

from libs.common import __version__
from libs.common.engine.core.sampling_params import (
    LOGIT_BIAS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_IDS,
    MAX_TOKEN_ID,
)
from services.router.api import messages_openapi, openapi_info, pins, responses_openapi
from services.router.api.openapi_parts import json_response, post, ref
from services.router.formats.anthropic.request import COUNT_SPECS, MESSAGES_SPECS
from services.router.formats.openai.messages import ROLES
from services.router.formats.openai.validation import (
    CHAT_SPECS,
    COMPLETION_SPECS,
    STREAM_OPTIONS,
    Spec,
    neutral_fields,
)
from services.router.formats.responses.request import LOGPROBS, RESPONSES_SPECS
from services.router.formats.responses.request import NEUTRAL as RESPONSES_NEUTRAL


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


_STR, _INT = {"type": "string"}, {"type": "integer"}
_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_IDS = {"type": "array", "items": _ID, "minItems": 1}
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    },
}
_CALL = _obj(
    ["id", "type", "function"],
    id=_STR,
    type={"const": "function"},
    function=_obj(["name", "arguments"], name=_STR, arguments=_STR),
)


def _message(role: str) -> dict[str, Any]:
    """A chat message of `role`, closed: the keys parse_messages accepts for it, no other."""
    props: dict[str, Any] = {"role": {"const": role}, "name": {"type": ["string", "null"]}}
    text = {"type": ["string", "null"] if role == "assistant" else "string"}
    props["content"] = {"oneOf": [text, _TEXT_PARTS]}
    required = ["role", "content"]
    if role == "assistant":
        required = ["role"]
        props["tool_calls"] = {"type": ["array", "null"], "items": _CALL}
        props["reasoning_content"] = {"type": ["string", "null"]}
    if role == "tool":
        required.append("tool_call_id")
        props["tool_call_id"] = _STR
    return _obj(required, **props) | {"additionalProperties": False}


_TOOL = _obj(
    ["type", "function"],
    type={"const": "function"},
    function=_obj(
        ["name"],
        name={"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        description={"type": ["string", "null"]},
        parameters={"type": "object"},
        strict={"type": ["boolean", "null"]},
    ),
)
_KINDS: dict[str, dict[str, Any]] = {
    **messages_openapi.KINDS,
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "string": {"type": "string"},
    "salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS},
    "object": {"type": "object"},
    "schema": {"type": ["object", "boolean", "string"]},
    "choices": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    "tools": {"type": "array", "items": {"type": "object"}},
    "chat_tools": {"type": "array", "items": _TOOL},
    "bias": {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]{1,9}$"},
        "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS, "maximum": LOGIT_BIAS},
    },
    "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
    "ids": {"type": "array", "items": _ID, "maxItems": MAX_STOP_IDS},
    "stop": {"oneOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOP}]},
    "prompt": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            _IDS,
            {"type": "array", "items": _IDS, "minItems": 1},
        ]
    },
    "include": {"type": "array", "items": {"enum": [LOGPROBS]}},
    "input": {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "object"}},
        ]
    },
    "messages": {
        "type": "array",
        "minItems": 1,
        "items": {"oneOf": [_message(r) for r in ROLES]},
    },
}
# Fields that are only valid together with another one.
_NEEDS = {
    "stream_options": ("stream", True),
    "top_logprobs": ("logprobs", True),
}


def _schema(
    specs: tuple[Spec, ...], neutral: dict[str, tuple[Any, ...]] | None = None
) -> dict[str, Any]:
    """A request's schema; given its `neutral` fields (accepted at those values only), it
    lists every field the parser accepts and no other (the parser refuses the others)."""
    props: dict[str, Any] = {
        name: {"enum": list(values), "description": "accepted at this neutral value only"}
        for name, values in (neutral or {}).items()
    }
    for s in specs:
        prop = {**_KINDS[s.kind], "description": s.help}
        if s.name == "stream_options":
            prop = {**prop, "additionalProperties": False,
                    "properties": {k: {"type": "boolean"} for k in STREAM_OPTIONS}}  # fmt: skip
        b = s.bound
        if b is not None and b.lo is not None:
            prop["exclusiveMinimum" if b.lo_open else "minimum"] = b.lo
        if b is not None and b.hi is not None:
            prop["maximum"] = b.hi
        props[s.name] = prop
    names = {s.name for s in specs}
    needs = {
        field: {"required": [other], "properties": {other: {"const": value}}}
        for field, (other, value) in _NEEDS.items()
        if field in names and other in names
    }
    return {
        "type": "object",
        "required": [s.name for s in specs if s.required],
        "properties": props,
        "dependentSchemas": needs,
    } | ({"additionalProperties": False} if neutral is not None else {})


_ANY: dict[str, Any] = {}  # any JSON value
_NULL_STR = {"type": ["string", "null"]}
USAGE = _obj(
    ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
    prompt_tokens=_INT,
    completion_tokens=_INT,
    total_tokens=_INT,
    prompt_tokens_details=_obj(["cached_tokens"], cached_tokens=_INT),
)
ERROR = _obj(
    ["error"],
    error=_obj(
        ["message", "type", "param", "code"],
        message=_STR,
        type=_STR,
        param=_NULL_STR,
        code=_NULL_STR,
    ),
)
_CHOICE_COMMON = {"index": _INT, "logprobs": _ANY, "finish_reason": _NULL_STR}
COMPLETION = _obj(
    ["id", "object", "created", "model", "choices", "usage"],
    id=_STR,
    object={"const": "text_completion"},
    created=_INT,
    model=_STR,
    choices={
        "type": "array",
        "items": _obj(["index", "text", "finish_reason"], text=_STR, **_CHOICE_COMMON),
    },
    usage=USAGE,
)
CHAT = _obj(
    ["id", "object", "created", "model", "choices", "usage"],
    id=_STR,
    object={"const": "chat.completion"},
    created=_INT,
    model=_STR,
    choices={
        "type": "array",
        "items": _obj(
            ["index", "message", "finish_reason"],
            message=_obj(
                ["role", "content"],
                role={"const": "assistant"},
                content={"type": ["string", "null"]},
                reasoning_content={"type": ["string", "null"]},
                tool_calls={"type": ["array", "null"], "items": _obj(["id", "type", "function"])},
            ),
            **_CHOICE_COMMON,
        ),
    },
    usage=USAGE,
)
MODELS = _obj(
    ["object", "data"],
    object={"const": "list"},
    data={"type": "array", "items": _obj(["id", "object", "created", "owned_by"], id=_STR)},
)
HEALTH = _obj(["status", "nats", "workers"], status={"enum": ["ok", "unavailable"]})
RENDER_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "additionalProperties": False,
    "properties": {
        "model": _STR,
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
        "add_generation_prompt": {"type": "boolean", "default": True},
        "continue_final_message": {"type": "boolean", "default": False},
        "chat_template_kwargs": {"type": "object"},
    },
}
RENDER = _obj(
    ["object", "prompt", "prompt_tokens"],
    object={"const": "chat.prompt"},
    prompt=_STR,
    prompt_tokens=_INT,
)
SCHEMAS = {
    "CompletionRequest": _schema(COMPLETION_SPECS, neutral_fields("completions")),
    "ResponseRequest": _schema(RESPONSES_SPECS, RESPONSES_NEUTRAL),
    "ChatCompletionRequest": _schema(CHAT_SPECS, neutral_fields("chat")),
    "Completion": COMPLETION,
    "ChatCompletion": CHAT,
    "ChatRenderRequest": RENDER_REQUEST,
    "ChatPrompt": RENDER,
    "MessagesRequest": _schema(MESSAGES_SPECS, {}),  # closed: no neutral-only fields
    "CountTokensRequest": _schema(COUNT_SPECS, {}),
    "ModelList": MODELS,
    "Health": HEALTH,
    "Error": ERROR,
}


_ERRORS = {
    str(code): json_response("Error", text)
    for code, text in (
        (400, "malformed or out-of-range request, prompt longer than the context"),
        (401, "missing or wrong API key (when the router has keys)"),
        (404, "unknown model"),
        (429, "the router's bound of requests in flight is reached (see Retry-After)"),
        (502, "a worker failed after the response started or twice"),
        (503, "no worker is live"),
        (504, "the request ran past --generate-timeout"),
    )
}


def _generate(request: str, response: str, summary: str) -> dict[str, Any]:
    ok, stream = "the completion (stream: false)", "SSE chunks, then `data: [DONE]`"
    return post(request, response, summary, ok, _ERRORS, stream)


def document(model_name: str) -> dict[str, Any]:
    """The whole document; `model_name` is the one value of `model` this router serves."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tandem router",
            "version": __version__,
            "description": f"OpenAI-compatible API serving '{model_name}'.",
        },
        "paths": {
            "/v1/completions": _generate("CompletionRequest", "Completion", "Text completion"),
            "/v1/chat/completions": _generate(
                "ChatCompletionRequest", "ChatCompletion", "Chat completion"
            ),
            "/v1/chat/render": {
                "post": {
                    "summary": "The prompt text a chat request would become (not run)",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": ref("ChatRenderRequest")}},
                    },
                    "responses": {
                        "200": json_response(
                            "ChatPrompt", "the rendered prompt and its token count"
                        ),
                        **{k: _ERRORS[k] for k in ("400", "401", "404")},
                    },
                }
            },
            "/v1/responses": _generate("ResponseRequest", "Response", "OpenAI Responses API"),
            **responses_openapi.PATHS,
            **messages_openapi.paths({k: v["description"] for k, v in _ERRORS.items()}),
            "/v1/models": {
                "get": {
                    "summary": "Served models",
                    "responses": {
                        "200": json_response("ModelList", "the served model"),
                        "401": _ERRORS["401"],
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Readiness",
                    "responses": {
                        "200": json_response("Health", "ready"),
                        "503": json_response("Health", "not ready"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "text exposition format"}},
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {"200": {"description": "OpenAPI 3.1"}},
                }
            },
            **pins.PATHS,
            **openapi_info.PATHS,
        },
        "components": {
            "schemas": {
                **SCHEMAS,
                **pins.SCHEMAS,
                **openapi_info.SCHEMAS,
                **responses_openapi.SCHEMAS,
                **messages_openapi.SCHEMAS,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
