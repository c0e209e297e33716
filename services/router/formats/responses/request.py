"""A POST /v1/responses body -> `ResponsesRequest`: the conversation in chat form and the
chat-shaped body whose `ApiRequest` runs it (lifecycle.run_request, shared by every format).

    req = read_body(body)                        # the closed field table; 400s name fields
    api = to_api(req, history, max_n)            # history: the previous response's messages

`RESPONSES_SPECS` is the one table of accepted fields (also /openapi.json's schema). A field
outside it is refused with a 400 naming it; `NEUTRAL` fields are accepted only at their
neutral value. Input items become chat messages:

    "text"                                     -> a user message
    {role, content: str | [input_text...]}      -> that message (developer -> system)
    {type: function_call, call_id, name, arguments}   -> an assistant's tool call
    {type: function_call_output, call_id, output}     -> a tool message

`instructions` is a first system message, never stored (OpenAI's rule: it does not carry
over to a response that continues this one). Tools are the flat Responses shape
({type: function, name, parameters, ...}); `text.format` is chat's `response_format`.
Errors of the shared chat checks are renamed to the Responses fields (`renamed`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from services.router.errors import ApiError, bad_request
from services.router.formats.openai.validation import (
    ApiRequest,
    Spec,
    check_field,
    is_neutral,
    parse_request,
    sampling_spec,
)

LOGPROBS = "message.output_text.logprobs"  # the one `include` value served
RESPONSES_SPECS = (
    Spec("model", "string", "model name, as listed by GET /v1/models", required=True),
    Spec("input", "input", "a string or items (message, function_call, ...)", required=True),
    Spec("instructions", "string", "a system message first (not carried to a next response)"),
    sampling_spec("max_output_tokens", "max_tokens"),
    sampling_spec("temperature"),
    sampling_spec("top_p"),
    sampling_spec("top_k"),
    sampling_spec("min_p"),
    sampling_spec("repetition_penalty"),
    sampling_spec("seed"),
    Spec("stream", "boolean", "stream the typed Server-Sent Events"),
    Spec("tools", "tools", "functions the model may call: [{type: function, name, parameters}]"),
    Spec("tool_choice", "tool_choice", "none, auto, required or {type: function, name}"),
    Spec("parallel_tool_calls", "boolean", "more than one call per answer (default true)"),
    Spec("text", "object", "`{format: {type: text | json_object | json_schema, ...}}`"),
    Spec("store", "boolean", "keep the response for GET and previous_response_id (default true)"),
    Spec("previous_response_id", "string", "continue the conversation of a stored response"),
    Spec("metadata", "object", "up to 16 string pairs, echoed and stored"),
    Spec("include", "include", f"[] or [{LOGPROBS!r}]: each output token's logprobs"),
    sampling_spec("top_logprobs", "logprobs", "alternatives per token, with logprobs included"),
    Spec("user", "string", "end-user id (logged)"),
)
# Accepted only at their neutral value: anything else is refused, never silently ignored.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled"),
    "background": (None, False),
    "reasoning": (None, {}),
    "service_tier": (None, "auto", "default"),
    "max_tool_calls": (None,),
    "stream_options": (None,),
}
FIELDS = frozenset(s.name for s in RESPONSES_SPECS) | frozenset(NEUTRAL)
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# Keys an input item may carry besides its content: our own output items come back as
# input with their id and status (openai-agents sends them so); they change nothing. Other
# keys are refused unless null (a client's own model of an item may dump its unset fields).
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
MAX_METADATA = 16
# The chat checks' field names -> the Responses fields they came from (`renamed`).
_RENAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "prompt": "input",
}


@dataclass
class ResponsesRequest:
    """A checked body: its fields (`fields`: name -> value, None when absent), the new
    input as chat messages, and the echo of the request in the response object."""

    fields: dict[str, Any]
    input: list[dict[str, Any]]
    store: bool = True
    previous_response_id: str | None = None
    chat: dict[str, Any] = field(default_factory=dict)  # the chat body to_api builds

    @property
    def stream(self) -> bool:
        return bool(self.fields["stream"])

    @property
    def logprobs(self) -> bool:
        """The output tokens' logprobs asked for (`include`)."""
        return LOGPROBS in (self.fields["include"] or [])


def valid_response_id(value: str) -> bool:
    return bool(_RESPONSE_ID.match(value))


def read_body(body: Any) -> ResponsesRequest:
    """Check `body` against the table; a 400 naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad_request(f"'{unknown[0]}' is not a field of /v1/responses", unknown[0])
    for name, neutral in NEUTRAL.items():
        if not is_neutral(body.get(name), neutral):  # of the same JSON type: 0 is not false
            raise bad_request(f"'{name}' is not supported by this server", name)
    values = {s.name: _check_field(s, body.get(s.name)) for s in RESPONSES_SPECS}
    metadata = values["metadata"] or {}
    if len(metadata) > MAX_METADATA or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad_request(f"'metadata' holds up to {MAX_METADATA} string values", "metadata")
    previous = values["previous_response_id"]
    if previous is not None and not valid_response_id(previous):
        raise previous_not_found(previous)
    store = values["store"] is not False
    return ResponsesRequest(values, input_messages(values["input"]), store, previous)


def previous_not_found(response_id: str) -> ApiError:
    return ApiError(
        400,
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _check_field(spec: Spec, value: Any) -> Any:
    if spec.kind == "input":
        if value is None:
            raise bad_request("'input' is required", "input")
        return value
    if spec.kind == "include":
        if value is not None and (not isinstance(value, list) or any(v != LOGPROBS for v in value)):
            raise bad_request(f"'include' may hold only {LOGPROBS!r}", "include")
        return value
    if spec.kind in ("tools", "tool_choice"):
        return value  # checked when converted (to_api), then by the chat tool checks
    return check_field(spec, value)


def to_api(req: ResponsesRequest, history: list[dict[str, Any]], max_n: int) -> ApiRequest:
    """The ApiRequest of chat's checks for this request after `history` (the stored
    conversation of previous_response_id); its errors name the Responses fields."""
    v = req.fields
    messages = [*history, *req.input]
    if v["instructions"]:
        messages.insert(0, {"role": "system", "content": v["instructions"]})
    chat: dict[str, Any] = {"model": v["model"], "messages": messages, "stream": req.stream}
    chat.update({k: v[k] for k in _SAMPLING if v[k] is not None})
    chat["max_completion_tokens"] = v["max_output_tokens"]
    chat["tools"] = _tools(v["tools"])
    chat["tool_choice"] = _tool_choice(v["tool_choice"])
    chat["parallel_tool_calls"] = v["parallel_tool_calls"]
    chat["response_format"] = _text_format(v["text"])
    chat["user"] = v["user"]
    if v["top_logprobs"] and not req.logprobs:
        raise bad_request(f"'top_logprobs' needs 'include': [{LOGPROBS!r}]", "top_logprobs")
    if req.logprobs and chat["tools"] and chat["tool_choice"] != "none":
        raise bad_request("output logprobs are not served with tools", "include")
    chat["logprobs"], chat["top_logprobs"] = req.logprobs or None, v["top_logprobs"]
    req.chat = chat
    with renamed():
        return parse_request("chat", chat, max_n)


@contextlib.contextmanager
def renamed() -> Iterator[None]:
    """ApiErrors raised inside name the Responses fields, not the chat fields they were
    translated to (`max_completion_tokens` -> `max_output_tokens`, ...)."""
    try:
        yield
    except ApiError as e:
        if e.param in _RENAMES:
            message = e.message.replace("'response_format.json_schema", "'text.format")
            e.message = message.replace(f"'{e.param}", f"'{_RENAMES[e.param]}")
            e.param = _RENAMES[e.param]
            e.args = (e.message,)
        raise


# --- input items -> chat messages ---------------------------------------------------------


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages (checked again by chat's message checks in to_api)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", "input")
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:
            raise bad_request(
                f"'{where}.type' {kind!r} is not supported: message, function_call and "
                "function_call_output are",
                "input",
            )
        extra = sorted(k for k, x in item.items() if k not in _ITEM_KEYS[kind] and x is not None)
        if extra:
            raise bad_request(f"'{where}.{extra[0]}' is not a field of a {kind} item", "input")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            _function_call(item, where, out)
        else:
            output = item.get("output")
            if isinstance(output, list):
                output = _text(output, f"{where}.output")
            if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"'{where}' needs a string 'call_id' and 'output'", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}", "input")
    content = item.get("content")
    if isinstance(content, list):
        content = _text(content, f"{where}.content")
    if not isinstance(content, str):
        raise bad_request(f"'{where}.content' must be a string or text parts", "input")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(parts: list[Any], where: str) -> str:
    """Text content parts (input_text, output_text) joined; any other part is a 400."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise bad_request(f"'{where}[{j}]': only input_text and output_text parts are "
                              "supported", "input")  # fmt: skip
        extra = sorted(set(part) - _PART_KEYS)
        if extra or not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{j}]' must be {{type, text}}", "input")
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    """A call the model made, as a tool call of an assistant message: the previous one
    when the model's text or other calls came right before it, else a new one."""
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise bad_request(f"'{where}' needs string 'call_id', 'name' and 'arguments'", "input")
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


# --- tools and text.format -> chat's fields ------------------------------------------------


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Flat Responses tools -> chat tools; only function tools are served."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f"'tools[{i}]': only function tools are supported "
                "({type: function, name, parameters})",
                "tools",
            )
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise bad_request(f"'tools[{i}].{extra[0]}' is not a field of a function tool",
                              "tools")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}  # fmt: skip
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and set(value)
        <= {
            "type",
            "name",
        }
    ):
        return {"type": "function", "function": {"name": value.get("name")}}
    raise bad_request(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def _text_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if not value:
        return None
    extra = sorted(set(value) - {"format", "verbosity"})
    if extra:
        raise bad_request(f"'text.{extra[0]}' is not supported", "text")
    if value.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' is not supported by this server", "text")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad_request("'text.format.type' must be text, json_object or json_schema", "text")
    extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
    if extra:
        raise bad_request(f"'text.format.{extra[0]}' is not a field of json_schema", "text")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}
