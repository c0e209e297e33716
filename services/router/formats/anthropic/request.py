"""Bodies of POST /v1/messages and /v1/messages/count_tokens -> the chat `ApiRequest`.

The Messages API is another spelling of a chat request, so it becomes the same
`ApiRequest` /v1/chat/completions makes, and runs the same way (lifecycle.run_request):

    system (string or text blocks)        -> a first "system" message
    user text blocks                      -> a "user" message (blocks joined by "\\n")
    user tool_result blocks               -> "tool" messages (tool_call_id = tool_use_id)
    assistant text and tool_use blocks    -> an "assistant" message with `tool_calls`
    tools [{name, description, input_schema}], tool_choice auto/any/tool/none
                                          -> the chat ToolRequest (auto/required/function/none;
                                             disable_parallel_tool_use -> one call at most)
    output_config.format json_schema      -> a grammar, like response_format
    stop_sequences, temperature, top_p, top_k, max_tokens -> the sampling fields

`MESSAGES_SPECS` and `COUNT_SPECS` are the closed field tables (also rendered into
/openapi.json): any other field, and any other key of a content block, tool or
tool_choice, is a 400 naming it. A conversation that ends with an assistant turn of text
is a prefill: the model continues that text (chat's continue_final_message), and the
response holds only what it adds.
"""

from __future__ import annotations

import json
import re
from typing import Any

from libs.common.engine.core.sampling_params import BOUNDS, Bound, SamplingError, check_stop
from services.router.errors import bad_request
from services.router.formats.openai.chat_template import TemplateArgs
from services.router.formats.openai.validation import ApiRequest, Spec
from services.router.structured.output import Grammar
from services.router.structured.tools.request import Tool, ToolRequest

_TEMPERATURE = Bound(float, "0 is greedy (Anthropic's range: at most 1)", lo=0, hi=1)
_COMMON = (
    Spec("model", "string", "model name, as listed by GET /v1/models", required=True),
    Spec("messages", "anthropic_messages", "the conversation: [{role, content}]", required=True),
    Spec("system", "system", "system prompt: a string or text blocks"),
    Spec("tools", "anthropic_tools", "client tools: [{name, description, input_schema}]"),
    Spec("tool_choice", "anthropic_tool_choice", "{type: auto | any | tool (with name) | none}"),
    Spec("output_config", "output_config", "{format: {type: json_schema, schema}}: enforced"),
    Spec("cache_control", "cache_control", "{type: ephemeral}: accepted; every prefix is cached"),
    Spec("thinking", "thinking", "{type: disabled} (no thinking) or {type: adaptive}"),
)
MESSAGES_SPECS = (
    *_COMMON[:2],
    Spec("max_tokens", "integer", BOUNDS["max_tokens"].help, BOUNDS["max_tokens"], True),
    *_COMMON[2:],
    Spec("stop_sequences", "strings", "strings that end the message (stop_reason stop_sequence)"),
    Spec("stream", "boolean", "stream Anthropic's server-sent events"),
    Spec("temperature", "number", _TEMPERATURE.help, _TEMPERATURE),
    Spec("top_p", "number", BOUNDS["top_p"].help, BOUNDS["top_p"]),
    Spec("top_k", "integer", BOUNDS["top_k"].help, BOUNDS["top_k"]),
    Spec("metadata", "metadata", "{user_id}: the end user, logged"),
)
COUNT_SPECS = _COMMON

# The JSON type of each kind (None: checked where it is read); the others are objects.
_TYPES: dict[str, type | None] = {
    "string": str, "boolean": bool, "anthropic_tools": list,
    "anthropic_messages": None, "system": None, "strings": None, "integer": None,
    "number": None,
}  # fmt: skip
_TYPE_NAMES = {str: "string", bool: "boolean", list: "list", dict: "object"}
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CACHE_TTLS = ("5m", "1h")
# The keys each kind of block may hold; a block with another key is refused.
_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
# An assistant turn's past thinking: accepted and left out of the prompt (a reasoning
# model's template drops past thinking; chat's `reasoning_content` likewise).
_THINKING = ("thinking", "redacted_thinking")
_TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "type", "strict"}
_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def parse(body: Any, path: str) -> ApiRequest:
    """Check a body of `path` (/v1/messages or its count_tokens) against its table; the chat
    ApiRequest it asks for, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    specs = COUNT_SPECS if path.endswith("count_tokens") else MESSAGES_SPECS
    unknown = sorted(set(body) - {s.name for s in specs})
    if unknown:
        raise bad_request(f"'{unknown[0]}' is not a field of {path}", unknown[0])
    v = {s.name: _check(s, body.get(s.name)) for s in specs}
    _cache_control(v["cache_control"], "cache_control")
    thinking = v["thinking"]
    if thinking is not None and thinking not in ({"type": "disabled"}, {"type": "adaptive"}):
        raise bad_request(
            "'thinking' is {type: disabled} or {type: adaptive} here: a thinking budget is "
            "not enforced by this server",
            "thinking",
        )
    req = ApiRequest(endpoint="chat", model=v["model"])
    req.messages = _system(v["system"]) + _messages(v["messages"])
    # "disabled" renders the template without thinking (Qwen3's enable_thinking; other
    # templates ignore it); a last assistant turn is a prefill: the model continues it.
    kwargs = {"enable_thinking": False} if thinking == {"type": "disabled"} else {}
    prefill = req.messages[-1]["role"] == "assistant"
    req.template = TemplateArgs(not prefill, prefill, kwargs)
    req.tools = _tool_request(v["tools"], v["tool_choice"])
    grammar = _output_format(v["output_config"])
    forced = req.tools is not None and req.tools.forced
    if forced and grammar is not None:
        raise bad_request(
            "one grammar per request: 'tool_choice' forces a tool call and "
            "'output_config.format' asks for another grammar",
            "tool_choice",
        )
    req.grammar = Grammar("tools", "tools") if forced else grammar
    if specs is COUNT_SPECS:
        return req
    req.stream, req.max_tokens = bool(v["stream"]), v["max_tokens"]
    metadata = v["metadata"] or {}
    if set(metadata) - {"user_id"} or not isinstance(metadata.get("user_id", ""), str | None):
        raise bad_request("'metadata' holds only 'user_id', a string", "metadata")
    req.user = metadata.get("user_id") or ""
    sampling = {k: v[k] for k in ("temperature", "top_p", "top_k") if v[k] is not None}
    stops = v["stop_sequences"]
    sampling["stop"], sampling["stop_token_ids"] = list(stops or []), []
    req.sampling = sampling  # its grammar: lifecycle.check builds it
    return req


def _check(spec: Spec, value: Any) -> Any:
    name = spec.name
    if value is None:
        if spec.required:
            raise bad_request(f"'{name}' is required", name)
        return None
    try:
        if spec.bound is not None:
            if spec.kind == "integer" and isinstance(value, float) and value.is_integer():
                value = int(value)
            return spec.bound.check(name, value)
        if spec.kind == "strings":
            if not isinstance(value, list):
                raise SamplingError(name, f"'{name}' must be a list of strings")
            return list(check_stop(name, value))
    except SamplingError as e:
        raise bad_request(str(e), name) from None
    expected = _TYPES.get(spec.kind, dict)  # the other kinds are objects
    if expected is not None and not isinstance(value, expected):
        raise bad_request(f"'{name}' must be a {_TYPE_NAMES[expected]}", name)
    return value


def _cache_control(value: Any, where: str) -> None:
    """Anthropic's cache breakpoint: accepted (the prefix cache keeps every prompt's pages,
    so a breakpoint's prefix is cached anyway); anything but its own shape is a 400."""
    if value is None:
        return
    ok = isinstance(value, dict) and value.get("type") == "ephemeral"
    if not ok or set(value) - {"type", "ttl"} or value.get("ttl", "5m") not in _CACHE_TTLS:
        raise bad_request(f"'{where}' must be {{type: ephemeral, ttl?: 5m | 1h}}", "cache_control")


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    text = _text(value, "system", "system")
    return [{"role": "system", "content": text}]


def _text(value: Any, where: str, param: str) -> str:
    """A string, or text blocks joined by "\\n"; a 400 for anything else."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of text blocks", param)
    blocks = [_block(b, f"{where}[{i}]", param, ("text",)) for i, b in enumerate(value)]
    return "\n".join(b["text"] for b in blocks)


def _block(block: Any, where: str, param: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """One content block of one of `kinds`, its keys and their types checked."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in kinds:
        raise bad_request(f"'{where}' must be a block of type {' or '.join(kinds)}", param)
    extra = sorted(set(block) - _BLOCK_KEYS[kind])
    if extra:
        raise bad_request(f"'{where}.{extra[0]}' is not supported in a {kind} block", param)
    _cache_control(block.get("cache_control"), f"{where}.cache_control")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise bad_request(f"'{where}.text' must be a string", param)
        if block.get("citations") not in (None, []):
            raise bad_request(f"'{where}.citations' is not supported by this server", param)
    elif kind in _THINKING:
        text = block.get("thinking" if kind == "thinking" else "data")
        if not isinstance(text, str) or not isinstance(block.get("signature", ""), str):
            raise bad_request(f"'{where}': a {kind} block holds strings", param)
    elif kind == "tool_use":
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            raise bad_request(f"'{where}' needs a string 'id' and 'name'", param)
        if not isinstance(block.get("input"), dict):
            raise bad_request(f"'{where}.input' must be an object", param)
    elif not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"'{where}.tool_use_id' must be a string", param)
    elif not isinstance(block.get("is_error", False), bool):
        raise bad_request(f"'{where}.is_error' must be a boolean", param)
    return block


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"'{where}' needs a 'role' among user, assistant", "messages")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise bad_request(f"'{where}.{extra[0]}' is not a field of a message", "messages")
        content = m.get("content")
        if isinstance(content, str) or role == "system":
            out.append({"role": role, "content": _text(content, f"{where}.content", "messages")})
        elif not isinstance(content, list):
            raise bad_request(f"'{where}.content' must be a string or blocks", "messages")
        elif role == "user":
            out += _user_turn(content, f"{where}.content")
        else:
            out.append(_assistant_turn(content, f"{where}.content"))
    last = out[-1]
    if last["role"] == "assistant" and (last.get("tool_calls") or not last["content"].strip()):
        raise bad_request(
            "a last assistant turn (a prefill) must be text to continue, without tool_use",
            "messages",
        )
    if last["role"] == "assistant" and last["content"] != last["content"].rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace",
                          "messages")  # fmt: skip
    return out


def _user_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    """A user turn's blocks: each tool_result a "tool" message, the text one user message."""
    out, texts = [], []
    for j, b in enumerate(blocks):
        block = _block(b, f"{where}[{j}]", "messages", ("text", "tool_result"))
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        result = block.get("content", "")
        text = _text(result, f"{where}[{j}].content", "messages")
        if block.get("is_error"):  # the chat format has no flag: the model reads it
            text = f"Error: {text}"
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list, where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        block = _block(b, f"{where}[{j}]", "messages", ("text", "tool_use", *_THINKING))
        if block["type"] in _THINKING:
            continue
        if block["type"] == "text":
            texts.append(block["text"])
        else:
            arguments = json.dumps(block["input"], ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_request(value: Any, choice_value: Any) -> ToolRequest | None:
    defined: list[Tool] = []
    for i, t in enumerate(value or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            raise bad_request(f"'{where}': only client tools (type custom) are supported", "tools")
        extra = sorted(set(t) - _TOOL_KEYS)
        if extra:
            raise bad_request(f"'{where}.{extra[0]}' is not supported by this server", "tools")
        name = t.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"'{where}.name' must be 1-64 of a-z, A-Z, 0-9, _ and -", "tools")
        if any(d.name == name for d in defined):
            raise bad_request(f"'{where}.name': {name!r} is given twice", "tools")
        schema = t.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad_request(f"'{where}.input_schema' must be a JSON schema of type object",
                              "tools")  # fmt: skip
        description = t.get("description")
        description = "" if description is None else description
        if not isinstance(description, str) or not isinstance(t.get("strict", False), bool):
            raise bad_request(f"'{where}': 'description' is a string, 'strict' a boolean", "tools")
        _cache_control(t.get("cache_control"), f"{where}.cache_control")
        defined.append(Tool(name, description, schema, bool(t.get("strict"))))
    choice, function, parallel = _choice(choice_value, defined)
    if not defined and choice in ("auto", "none"):
        return None
    return ToolRequest(tuple(defined), choice, function, parallel)


def _choice(value: Any, defined: list[Tool]) -> tuple[str, str | None, bool]:
    """tool_choice -> (the chat choice, the forced function, parallel calls allowed)."""
    if value is None:
        return ("auto" if defined else "none"), None, True
    kind = value.get("type")
    if kind not in _CHOICES:
        raise bad_request("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
    allowed = {"type"} | ({"name"} if kind == "tool" else set())
    allowed |= {"disable_parallel_tool_use"} if kind != "none" else set()
    extra = sorted(set(value) - allowed)
    if extra:
        raise bad_request(f"'tool_choice.{extra[0]}' is not a field of a {kind} choice",
                          "tool_choice")  # fmt: skip
    single = value.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise bad_request("'tool_choice.disable_parallel_tool_use' must be a boolean",
                          "tool_choice")  # fmt: skip
    if kind in ("any", "tool") and not defined:
        raise bad_request(f"'tool_choice' {kind} needs 'tools'", "tool_choice")
    name = value.get("name")
    if kind == "tool" and not any(t.name == name for t in defined):
        raise bad_request(f"'tool_choice.name' {name!r} is not one of 'tools'", "tool_choice")
    return _CHOICES[kind], (name if kind == "tool" else None), not single


def _output_format(value: Any) -> Grammar | None:
    """output_config: `format` json_schema becomes the request's grammar; `effort` (a
    reasoning budget) is refused but for its neutral null."""
    if value is None:
        return None
    extra = sorted(set(value) - {"format", "effort"})
    if extra or value.get("effort") is not None:
        field = extra[0] if extra else "effort"
        raise bad_request(f"'output_config.{field}' is not supported by this server",
                          "output_config")  # fmt: skip
    spec = value.get("format")
    if spec is None:
        return None
    if (
        not isinstance(spec, dict)
        or spec.get("type") != "json_schema"
        or set(spec)
        != {
            "type",
            "schema",
        }
    ):
        raise bad_request("'output_config.format' must be {type: json_schema, schema}",
                          "output_config")  # fmt: skip
    if not isinstance(spec["schema"], dict | bool):
        raise bad_request("'output_config.format.schema' must be a JSON schema (an object)",
                          "output_config")  # fmt: skip
    return Grammar("output_config", "json", spec["schema"])  # built by lifecycle.check
