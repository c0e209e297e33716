"""OpenAI tool calling: `tools`, `tool_choice`, `parallel_tool_calls` in; tool calls out.

    req = parse_tools(body)                       # ToolRequest | None; 400s name the field
    check_tool_messages(body["messages"])         # assistant tool_calls, tool_call_id
    messages, kwargs = render_messages(messages, req, template_has_tools(template))
    # the forcing grammar and the schemas' check: grammar.py (tool_grammar, check_tool_grammar)
    # the output: parse.py (parse_tool_calls, ToolCallStream)

The model calls a tool in the Hermes format that Qwen's and Hermes's chat templates
teach, one block per call, blocks separated by "\\n":

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Templates that render `tools` themselves get the OpenAI tool dicts as the `tools` keyword
and the history as given, except that an assistant's `function.arguments` goes to the
template parsed (a dict): Hugging Face templates apply `tojson` to it, which would
quote a JSON string a second time.

Fallback, for templates that do not mention `tools` (plain ChatML such as SmolLM2's):
  - tools_prompt() goes before the content of the first message when it is a system
    message, or becomes a new first system message (replacing the template's default one);
  - an assistant's tool_calls become "<tool_call>\\n{json}\\n</tool_call>" blocks after its
    content, in the exact format the model is asked to write;
  - "tool" messages become "user" messages whose content is
    "<tool_response>\\n...\\n</tool_response>"; consecutive ones merge into one user turn,
    in call order. A user turn renders through every template (some refuse unknown roles)
    and is where Qwen's own template puts tool responses; a model never trained on a
    "tool" role reads a user turn sensibly.
  Fallback messages keep only `role` and string `content`.
With no tools or tool_choice "none" neither way shows the tools (no `tools` keyword, no
tools prompt); a history with tool calls still renders. Every template message's content
is a string.

A tool's `strict` is recorded but changes nothing: a forcing grammar always enforces the
parameters schema, and "auto" output is parsed, never constrained.

How the output is read back into calls: services/router/structured/tools/parse.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.router.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# A parameters schema must describe an object: a known JSON type other than it is refused
# here; an unknown one is left to the compiler (grammar.py, check_tool_grammar).
_NOT_OBJECT = ("string", "number", "integer", "boolean", "array", "null")
_JINJA_TAG = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
# OpenAI's deprecated fields, their neutral value (accepted) and what replaced them.
_LEGACY: tuple[tuple[str, Any, str], ...] = (
    ("functions", [], "tools"),
    ("function_call", "none", "tool_choice"),
)


@dataclass(frozen=True)
class Tool:
    name: str  # ^[a-zA-Z0-9_-]{1,64}$ as OpenAI requires
    description: str
    parameters: dict  # a JSON schema; {"type": "object", "properties": {}} when absent
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request shape (what chat templates expect)."""
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None  # the forced function's name when choice == "function"
    parallel: bool  # parallel_tool_calls (default True)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def forced(self) -> bool:
        """Whether the output is forced into tool calls (tool_grammar is not None)."""
        return self.choice in ("required", "function")


# --- the request ------------------------------------------------------------------------


def parse_tools(body: dict) -> ToolRequest | None:
    """The tool request in a chat body, or None when it asks for no tools; 400s name the
    offending field."""
    for legacy, neutral, instead in _LEGACY:
        if body.get(legacy) not in (None, neutral):
            raise bad_request(
                f"'{legacy}' is deprecated and not supported; use '{instead}'", legacy
            )
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    tools = _tools(body.get("tools"))
    choice, function = _choice(body.get("tool_choice"), tools)
    if not tools and choice in ("none", "auto"):
        return None
    return ToolRequest(tools, choice, function, parallel)


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", "tools")
    tools: list[Tool] = []
    names: set[str] = set()
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise bad_request(
                f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        spec = item.get("function")
        if not isinstance(spec, dict):
            raise bad_request(f"'{where}.function' must be an object", "tools")
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"'{where}.function.name' must be 1-64 of a-z, A-Z, 0-9, _ and -", "tools"
            )
        if name in names:
            raise bad_request(f"'{where}.function.name': {name!r} is given twice", "tools")
        names.add(name)
        description = spec.get("description", "")
        if not isinstance(description, str | None):
            raise bad_request(f"'{where}.function.description' must be a string", "tools")
        parameters = spec.get("parameters")
        if parameters is None:
            parameters = dict(_EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type") in _NOT_OBJECT:
            raise bad_request(
                f"'{where}.function.parameters' must be a JSON schema of an object", "tools"
            )
        strict = spec.get("strict", False)
        if not isinstance(strict, bool | None):
            raise bad_request(f"'{where}.function.strict' must be a boolean", "tools")
        tools.append(Tool(name, description or "", parameters, bool(strict)))
    return tuple(tools)


def _choice(value: Any, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    param = "tool_choice"
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str) and value in CHOICES:
        if value == "required" and not tools:
            raise bad_request("'tool_choice' 'required' needs 'tools'", param)
        return value, None
    spec = value.get("function") if isinstance(value, dict) else None
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str) or value.get("type") != "function":
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param,
        )
    if not any(t.name == name for t in tools):
        raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools'", param)
    return "function", name


def check_tool_messages(messages: list) -> None:
    """The tool fields of a conversation: an assistant's `tool_calls` and a tool message's
    `tool_call_id`; a 400 (param "messages") naming the message. Other fields are checked
    elsewhere (validation.py); non-dict items are left to those checks."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        where = f"messages[{i}]"
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"'{where}.tool_call_id' must be a string", "messages")
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or calls is None:
            continue
        if not isinstance(calls, list):
            raise bad_request(f"'{where}.tool_calls' must be a list", "messages")
        for j, call in enumerate(calls):
            _check_call(call, f"{where}.tool_calls[{j}]")


def _check_call(call: Any, where: str) -> None:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str):
        raise bad_request(f"'{where}' must be an object with a string 'id'", "messages")
    if call.get("type") != "function":
        raise bad_request(f"'{where}.type' must be 'function'", "messages")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"'{where}.function' must be an object with a string 'name'", "messages")
    arguments = function.get("arguments")
    if not isinstance(arguments, str) or parse_json(arguments) is INVALID:
        raise bad_request(f"'{where}.function.arguments' must be a string of JSON", "messages")


# --- the prompt -------------------------------------------------------------------------


def tools_prompt(req: ToolRequest) -> str:
    """System-prompt text for templates that do not render tools: the tools as JSON, one a
    line, and how to call them."""
    lines = [
        "You can call functions to help answer. These are available, one JSON object a line:",
        "<tools>",
        *(json.dumps(t.openai(), ensure_ascii=False) for t in req.tools),
        "</tools>",
        "To call a function, write its name and a JSON object of arguments that fits its "
        "parameters, between tags, exactly like this:",
        OPEN,
        '{"name": "<function name>", "arguments": {"<parameter>": <value>}}',
        CLOSE,
    ]
    if req.parallel:
        lines.append("To call several functions, write one block for each, a line apart.")
    else:
        lines.append("Call at most one function in a reply.")
    if req.choice == "required":
        lines.append("You must call at least one function now.")
    elif req.choice == "function":
        lines.append(f"You must call the function {req.function!r} now.")
    lines.append("The results come back between <tool_response> and </tool_response> tags.")
    return "\n".join(lines)


def template_has_tools(template: str | None) -> bool:
    """Whether a Jinja chat template renders `tools` (mentions it inside a tag)."""
    if not template:
        return False
    return any(re.search(r"\btools\b", tag) for tag in _JINJA_TAG.findall(template))


def render_messages(
    messages: list[dict], req: ToolRequest | None, template_has_tools: bool
) -> tuple[list[dict], dict]:
    """Messages ready for the chat template and its extra keyword arguments (see the module
    docstring for the two ways)."""
    offered = req if req is not None and req.choice != "none" and req.tools else None
    if template_has_tools:
        out = [_for_template(m) for m in messages]
        return out, ({"tools": [t.openai() for t in offered.tools]} if offered is not None else {})
    out = _as_text(messages)
    if offered is not None:
        prompt = tools_prompt(offered)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{prompt}\n\n{out[0]['content']}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _as_text(messages: list[dict]) -> list[dict]:
    """The history for a template that knows nothing of tools: calls and responses as
    tagged text, tool messages as user turns (consecutive ones merged)."""
    out: list[dict] = []
    previous = None
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            if m["role"] == "assistant" and m.get("tool_calls"):
                blocks = "\n".join(_call_text(c) for c in m["tool_calls"])
                content = f"{content}\n{blocks}" if content else blocks
            out.append({"role": m["role"], "content": content})
        previous = m["role"]
    return out


def _for_template(m: dict) -> dict:
    """A message for a template that renders tools: string content, and each call's
    arguments parsed (templates `tojson` them)."""
    out = dict(m)
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [_parsed_arguments(c) for c in m["tool_calls"]]
    return out


def _parsed_arguments(call: dict) -> dict:
    function = dict(call["function"])
    arguments = parse_json(function["arguments"])
    if arguments is not INVALID:
        function["arguments"] = arguments
    return {**call, "function": function}


def _call_text(call: dict) -> str:
    """An assistant's past call in the format the model writes (compact JSON)."""
    function = call["function"]
    arguments = parse_json(function["arguments"])
    if arguments is INVALID:  # refused by check_tool_messages; kept as given otherwise
        arguments = function["arguments"]
    text = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{text}\n{CLOSE}"


INVALID = object()  # what parse_json returns for text that is not JSON


def parse_json(text: str) -> Any:
    """`text` as JSON, or INVALID."""
    try:
        return json.loads(text)
    except ValueError:
        return INVALID
