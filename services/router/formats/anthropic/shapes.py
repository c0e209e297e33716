"""Responses in Anthropic's shapes: the message object, its stream events, its errors.

    message(id, model, blocks, stop_reason, stop_sequence, usage)       # stream: false
    event(name, body) -> bytes    # "event: <name>\\ndata: <json>\\n\\n", Anthropic's framing
    error_body(ApiError)          # {"type": "error", "error": {"type", "message"}}

Usage follows Anthropic's split of the prompt: `input_tokens` are the prompt tokens not
read from a cache, `cache_read_input_tokens` those read from one (the workers' cached
tokens), so input_tokens + cache_read_input_tokens is the whole prompt. Nothing is
written to a cache on request (every prefix is cached anyway): cache_creation is 0.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

import orjson

from services.router.errors import ApiError

_ID_CHARS = string.ascii_letters + string.digits
# Anthropic's error `type` per status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The chat finish reasons (the workers') as Anthropic's stop reasons; "stop" is end_turn
# unless a stop sequence or a tool call ended the message (see stop_reason).
_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def new_id(prefix: str) -> str:
    """`prefix` + 24 random alphanumerics: msg_..., toolu_..."""
    return prefix + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class Usage:
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens - self.cached_tokens,
            "output_tokens": self.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
        }


def stop_reason(finish_reason: str | None, called: bool, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason for a message whose choice ended with `finish_reason`."""
    if finish_reason == "stop" and called:
        return "tool_use"
    if finish_reason == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    """A reasoning model's thinking; `signature` (Anthropic's proof that the thinking is
    its own, for a later turn) is empty: this server does not sign, nor check one."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def message(
    mid: str,
    model: str,
    content: list[dict[str, Any]],
    reason: str | None,
    sequence: str | None,
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage.body(),
    }


def event(name: str, body: dict[str, Any]) -> bytes:
    """One server-sent event in Anthropic's framing: the event's name, then its JSON (whose
    `type` is the name too)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **body}) + b"\n\n"


def error_body(e: ApiError) -> dict[str, Any]:
    kind = _TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}
