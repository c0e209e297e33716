"""Chat messages of a request body -> the plain dicts the chat template renders.

Each role has a closed set of keys: a key outside it is a 400 naming it, never dropped
in silence. Content is a string or a list of text parts (joined); an assistant message
may have no content (it made tool calls). `reasoning_content` on an assistant message is
accepted and left out of the prompt, as vLLM does: a reasoning model's earlier thinking
does not go back into its context.
"""

from __future__ import annotations

from typing import Any

from services.router.errors import bad_request

ROLES = ("system", "user", "assistant", "developer", "tool")
# Keys each role may carry; those in _KEPT reach the chat template with role and content.
_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "reasoning_content"},
    "tool": {"role", "content", "name", "tool_call_id"},
}
# An assistant's calls and a tool's answer (checked with the tools, tools/request.py).
_KEPT = ("name", "tool_calls", "tool_call_id")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """`messages` checked, as template-ready dicts; a 400 naming the first bad one."""
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", "messages")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise bad_request(f"'{where}' needs a 'role' among {', '.join(ROLES)}", "messages")
    role = m["role"]
    unknown = sorted(set(m) - _KEYS[role])
    if unknown:
        raise bad_request(
            f"'{where}.{unknown[0]}' is not a key of a {role} message "
            f"(one of {', '.join(sorted(_KEYS[role]))})",
            f"{where}.{unknown[0]}",
        )
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is served here
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"'{where}.content': only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}.content': a text part needs 'text'", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"'{where}.content' must be a string or text parts", "messages")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise bad_request(f"'{where}.name' must be a string", f"{where}.name")
    message = {"role": "system" if role == "developer" else role, "content": content}
    for key in _KEPT:
        if m.get(key) is not None:
            message[key] = m[key]
    return message
