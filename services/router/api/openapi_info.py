"""/openapi.json's part for the model and tokenizer endpoints: GET /v1/models/{model_id},
GET /version, POST /tokenize and POST /detokenize (models.py, tokens.py)."""

from __future__ import annotations

from typing import Any

from services.router.api.openapi_parts import json_response, post

_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def _errors(*pairs: tuple[int, str]) -> dict[str, Any]:
    return {str(code): json_response("Error", text) for code, text in pairs}


_TOKEN_ERRORS = _errors(
    (400, "malformed request or an id outside the vocabulary"),
    (401, "missing or wrong API key"),
    (404, "unknown model"),
)


def _post(request: str, response: str, summary: str, ok: str) -> dict[str, Any]:
    return post(request, response, summary, ok, _TOKEN_ERRORS)


_CHAT_TOKENIZE = {
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
    "tools": {"type": "array", "items": {"type": "object"}},
    "add_generation_prompt": _BOOL,
    "continue_final_message": _BOOL,
    "chat_template_kwargs": {"type": "object"},
}
_COMMON = {"model": _STR, "add_special_tokens": _BOOL, "return_token_strs": _BOOL}
SCHEMAS: dict[str, Any] = {
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": _STR,
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": _STR,
            "max_model_len": _INT,
        },
    },
    "Version": {"type": "object", "required": ["version"], "properties": {"version": _STR}},
    "TokenizeRequest": {
        "oneOf": [
            {
                "type": "object",
                "required": ["prompt"],
                "additionalProperties": False,
                "properties": {"prompt": _STR, **_COMMON},
            },
            {
                "type": "object",
                "required": ["messages"],
                "additionalProperties": False,
                "properties": {**_CHAT_TOKENIZE, **_COMMON},
            },
        ]
    },
    "Tokens": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": _INT,
            "max_model_len": _INT,
            "tokens": _IDS,
            "token_strs": {"type": "array", "items": _STR},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "additionalProperties": False,
        "properties": {"model": _STR, "tokens": _IDS},
    },
    "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
}
PATHS: dict[str, Any] = {
    "/v1/models/{model_id}": {
        "get": {
            "summary": "The served model (openai's models.retrieve)",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": _STR}],
            "responses": {
                "200": json_response("Model", "the model"),
                **_errors((401, "missing or wrong API key"), (404, "not the served model")),
            },
        }
    },
    "/version": {
        "get": {
            "summary": "The server's version",
            "responses": {"200": json_response("Version", "")},
        }
    },
    "/tokenize": _post(
        "TokenizeRequest",
        "Tokens",
        "A prompt's or chat's token ids",
        "the ids /v1/completions or /v1/chat/completions would run",
    ),
    "/detokenize": _post("DetokenizeRequest", "Detokenized", "Token ids as text", "the text"),
}
