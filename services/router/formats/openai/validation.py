"""Request bodies of /v1/completions and /v1/chat/completions -> a typed `ApiRequest`.

One table of `Spec`s per endpoint is the single truth about what the API accepts: the
parser checks bodies against it and `openapi.py` renders it into /openapi.json. The
sampling fields' bounds and stop limits are not defined here but taken from
libs/common/engine/core/sampling_params.py, which the wire message and the engine check
too. Any bad value becomes a 400 naming the parameter, and so does any field outside the
table (vLLM and OpenAI ignore those; a field this server would not enforce must not look
accepted): the table is the closed set of what a request may say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from libs.common.engine.core.sampling_params import (
    BOUNDS,
    MAX_CACHE_SALT_CHARS,
    Bound,
    SamplingError,
    check_cache_salt,
    check_stop,
    check_token_ids,
)
from services.router.errors import bad_request
from services.router.formats.openai import vllm_fields
from services.router.formats.openai.chat_template import TemplateArgs, template_args
from services.router.formats.openai.messages import parse_messages
from services.router.formats.openai.vllm_fields import VllmFields
from services.router.structured import output as structured
from services.router.structured.output import Grammar
from services.router.structured.tools import request as tools
from services.router.structured.tools.request import ToolRequest


@dataclass(frozen=True)
class Spec:
    """One accepted field: JSON kind, and the `bound` of a number."""

    name: str
    kind: str  # integer, number, boolean, string, stop, ids, prompt, messages, object, bias
    help: str
    bound: Bound | None = None
    required: bool = False


def sampling_spec(name: str, bound: str | None = None, help: str = "") -> Spec:
    """A number bounded by the sampling table (`bound`: its entry, when named otherwise)."""
    b = BOUNDS[bound or name]
    return Spec(name, "integer" if b.kind is int else "number", help or b.help, bound=b)


_SAMPLING = (
    Spec("model", "string", "model name, as listed by GET /v1/models", required=True),
    Spec("n", "integer", "choices per prompt", bound=Bound(int, "choices per prompt", lo=1)),
    Spec("stream", "boolean", "stream Server-Sent Events"),
    Spec(
        "stream_options",
        "object",
        "`{include_usage: bool, continuous_usage_stats: bool}` for streams",
    ),
    sampling_spec("max_tokens"),
    sampling_spec("temperature"),
    sampling_spec("top_p"),
    sampling_spec("top_k"),
    sampling_spec("min_p"),
    sampling_spec("seed"),
    Spec("stop", "stop", "string or list of strings that end the completion"),
    Spec("stop_token_ids", "ids", "token ids that end the completion"),
    Spec("ignore_eos", "boolean", "keep generating past end-of-sequence"),
    sampling_spec("presence_penalty"),
    sampling_spec("frequency_penalty"),
    sampling_spec("repetition_penalty"),
    Spec("user", "string", "end-user id (logged)"),
    Spec("response_format", "object", "text, json_object or json_schema: output enforced"),
    Spec("regex", "string", "the output fully matches this regular expression"),
    Spec("ebnf", "string", "the output follows this grammar (GBNF or Lark)"),
    Spec("structured_outputs", "object", "vLLM's {json | regex | choice | grammar}: enforced"),
    Spec("guided_json", "schema", "a JSON schema the output follows (vLLM's older name)"),
    Spec("guided_regex", "string", "the output matches this regex (vLLM's older name)"),
    Spec("guided_choice", "choices", "the output is one of these strings (vLLM's older name)"),
    Spec("guided_grammar", "string", "the output follows this grammar (vLLM's older name)"),
    Spec(
        "cache_salt",
        "salt",
        f"1 to {MAX_CACHE_SALT_CHARS} chars: cached KV is shared only between requests with "
        "the same salt (vLLM's field; docs/security.md)",
    ),
    # vLLM's and SGLang's extensions, checked in vllm_fields.py
    sampling_spec("min_tokens"),
    Spec(
        "priority",
        "integer",
        "vLLM's: order within the tenant's queue, lower first (default 0; docs/routing.md)",
        bound=Bound(int, "order within the tenant's queue", lo=-(2**31), hi=2**31 - 1),
    ),
    Spec("logit_bias", "bias", "{token id: bias in [-100, 100]}, at most 300 ids"),
    Spec("return_token_ids", "boolean", "the prompt's and each choice's token ids"),
    sampling_spec("prompt_logprobs", "logprobs", "logprob, rank and top n of each prompt token"),
)
COMPLETION_SPECS = (
    Spec("prompt", "prompt", "string, list of strings, token ids or lists of ids", required=True),
    # max_tokens 0 scores a prompt without a completion: only with echo (OpenAI's rule).
    *(s for s in _SAMPLING if s.name != "max_tokens"),
    Spec(
        "max_tokens",
        "integer",
        BOUNDS["max_tokens"].help + " (0: with echo only)",
        bound=Bound(int, BOUNDS["max_tokens"].help, lo=0),
    ),
    sampling_spec("logprobs"),
    Spec("echo", "boolean", "prepend the prompt to the completion (with logprobs: scored)"),
    Spec(
        "prompt_logprobs_from",
        "integer",
        "with echo and logprobs: score the prompt from the token holding this character "
        "on; the cached prefix before it is not recomputed (Tandem's extension)",
        bound=Bound(int, "a character offset into the prompt", lo=0),
    ),
)
CHAT_SPECS = (
    Spec("messages", "messages", "the conversation: [{role, content}]", required=True),
    *_SAMPLING,
    sampling_spec("max_completion_tokens", "max_tokens"),
    Spec("logprobs", "boolean", "return log probabilities of the output tokens"),
    sampling_spec("top_logprobs", "logprobs", "alternatives per token"),
    Spec("tools", "chat_tools", "functions the model may call: [{type: function, function}]"),
    Spec("tool_choice", "tool_choice", "none, auto, required or {type: function, function}"),
    Spec("parallel_tool_calls", "boolean", "more than one call per answer (default true)"),
    Spec("add_generation_prompt", "boolean", "open the assistant's turn (default true)"),
    Spec(
        "continue_final_message",
        "boolean",
        "the model continues the last (assistant) message; not with add_generation_prompt",
    ),
    Spec("chat_template_kwargs", "object", "more variables for the chat template"),
)
# Accepted only at their neutral value: anything else is refused, never silently ignored.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),  # beam search's
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),  # the output's text never shows them
    "store": (None, False),  # OpenAI's: kept for distillation
    "service_tier": (None, "auto", "default"),
}
# Chat's own neutral-only fields. Tool calling is chat's: on /v1/completions its fields
# are refused the same way.
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "functions": (None, []),
    "function_call": (None, "none"),
}
_CHAT_ONLY: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}
# stream_options' keys (continuous_usage_stats: vllm_fields.py).
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# The sampling fields copied from the body as they are (max_tokens and logprobs have API
# aliases and defaults of their own, set per endpoint below).
_SAMPLING_KEYS = (*(k for k in BOUNDS if k not in ("max_tokens", "logprobs")), "ignore_eos")


@dataclass
class ApiRequest:
    """A validated request. `prompts` holds strings or token-id lists (completions);
    chat requests have `messages` instead. `max_tokens` None means up to the context."""

    endpoint: str  # "completions" or "chat"
    model: str
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs_from: int | None = None  # a character offset (completions, echo)
    sampling: dict[str, Any] = field(default_factory=dict)
    user: str = ""
    priority: int = 0  # within the tenant's queue, lower first (admission/gate.py)
    grammar: Grammar | None = None  # what the output must follow (structured/output.py)
    tools: ToolRequest | None = None  # chat's tools and tool_choice (structured/tools/request.py)
    template: TemplateArgs = field(default_factory=TemplateArgs)  # chat: how it is rendered
    vllm: VllmFields = field(default_factory=VllmFields)  # vLLM's extensions (vllm_fields.py)


def parse_request(endpoint: str, body: Any, max_n: int) -> ApiRequest:
    """Check `body` (decoded JSON) against the endpoint's specs; raise ApiError(400)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    specs = COMPLETION_SPECS if endpoint == "completions" else CHAT_SPECS
    _closed(endpoint, body, specs)
    v = {s.name: check_field(s, body.get(s.name)) for s in specs}
    req = ApiRequest(endpoint=endpoint, model=v["model"])
    req.n = 1 if v["n"] is None else v["n"]
    if req.n > max_n:
        raise bad_request(f"'n' must be <= {max_n}, got {req.n}", "n")
    req.stream = bool(v["stream"])
    options = v["stream_options"] or {}
    for key in sorted(options):
        if key not in STREAM_OPTIONS:
            raise bad_request(f"'stream_options.{key}' is not supported by this server",
                              f"stream_options.{key}")  # fmt: skip
    echo_scored = bool(v.get("echo")) and v.get("logprobs") is not None
    req.vllm = vllm_fields.parse(v, req.stream, echo_scored)
    req.include_usage = req.vllm.include_usage
    req.user = v["user"] or ""
    req.priority = v["priority"] or 0
    sampling = {k: v[k] for k in _SAMPLING_KEYS if v[k] is not None}
    sampling["stop"] = [v["stop"]] if isinstance(v["stop"], str) else list(v["stop"] or [])
    sampling["stop_token_ids"] = list(v["stop_token_ids"] or [])
    if v["cache_salt"] is not None:
        sampling["cache_salt"] = v["cache_salt"]
    if v["logit_bias"] is not None:
        sampling["logit_bias"] = vllm_fields.logit_bias(v["logit_bias"])
    req.grammar = structured.from_body(body)
    if endpoint == "chat":
        req.tools = tools.parse_tools(body)
        tools.check_tool_messages(body["messages"])
        forced = req.tools is not None and req.tools.forced
        if forced and req.grammar is not None:
            raise bad_request(
                f"one grammar per request: 'tool_choice' forces tool calls and "
                f"'{req.grammar.param}' asks for another grammar",
                "tool_choice",
            )
        if forced:  # its text is built and checked with the tools (lifecycle.check)
            req.grammar = Grammar("tools", "tools")
    req.sampling = sampling
    if endpoint == "completions":
        req.prompts = _prompts(v["prompt"])
        if len(req.prompts) * req.n > max_n:  # each choice is a request on the workers
            raise bad_request(
                f"{len(req.prompts)} prompts x n={req.n} choices is more than this server's "
                f"{max_n} per request",
                "prompt",
            )
        req.max_tokens = 16 if v["max_tokens"] is None else v["max_tokens"]  # OpenAI's default
        req.logprobs, req.echo = v["logprobs"], bool(v["echo"])
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("'max_tokens' 0 needs 'echo': true (the prompt scored only)",
                              "max_tokens")  # fmt: skip
        req.prompt_logprobs_from = v["prompt_logprobs_from"]
        if req.prompt_logprobs_from is not None and not (req.echo and req.logprobs is not None):
            raise bad_request("'prompt_logprobs_from' needs 'echo': true and 'logprobs'",
                              "prompt_logprobs_from")  # fmt: skip
    else:
        req.messages = parse_messages(v["messages"])
        req.template = template_args(body, req.messages)
        req.max_tokens = v["max_completion_tokens"] or v["max_tokens"]
        if v["top_logprobs"] is not None and not v["logprobs"]:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        req.logprobs = (v["top_logprobs"] or 0) if v["logprobs"] else None
    return req


def neutral_fields(endpoint: str) -> dict[str, tuple[Any, ...]]:
    """The fields `endpoint` accepts at their neutral values only, with those values."""
    if endpoint == "chat":
        return {**_NEUTRAL, **_CHAT_NEUTRAL}
    return {**_NEUTRAL, **_CHAT_ONLY}


def _closed(endpoint: str, body: dict[str, Any], specs: tuple[Spec, ...]) -> None:
    """A 400 naming the first field outside the endpoint's table, or a neutral-only field
    at another value than its neutral one."""
    neutral = {**_NEUTRAL, **(_CHAT_NEUTRAL if endpoint == "chat" else {})}
    known = {s.name for s in specs} | set(neutral_fields(endpoint))
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    for name in sorted(body):
        if name not in known:
            raise bad_request(f"'{name}' is not a field of {path} on this server", name)
    for name, values in neutral.items():
        if not is_neutral(body.get(name), values):
            raise bad_request(f"'{name}' is not supported by this server", name)
    if endpoint == "completions":
        for name, values in _CHAT_ONLY.items():
            if not is_neutral(body.get(name), values):
                raise bad_request(f"'{name}' is for /v1/chat/completions only", name)


def is_neutral(value: Any, values: tuple[Any, ...]) -> bool:
    """`value` is one of `values`, of the same JSON type (1 is not true, nor 1.0 false)."""
    return any(value == n and _json_type(value) == _json_type(n) for n in values)


def _json_type(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    return "number" if isinstance(value, int | float) else type(value).__name__


def check_field(spec: Spec, value: Any) -> Any:
    name = spec.name
    if value is None:
        if spec.required:
            raise bad_request(f"'{name}' is required", name)
        return None
    kind = spec.kind
    if kind == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON has one number type: 3.0 is the integer 3
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"'{name}' must be an integer, got {_show(value)}", name)
        _bounds(spec, value)
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"'{name}' must be a number, got {_show(value)}", name)
        if not math.isfinite(value):
            raise bad_request(f"'{name}' must be finite", name)
        _bounds(spec, value)
    elif kind == "boolean" and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {_show(value)}", name)
    elif kind == "string" and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {_show(value)}", name)
    elif kind in ("object", "bias") and not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object, got {_show(value)}", name)
    elif kind == "stop":
        _sampling_check(check_stop, name, value)
    elif kind == "salt":
        _sampling_check(check_cache_salt, name, value)
    elif kind == "ids":
        value = _ids(value)
        if value is None:
            raise bad_request(f"'{name}' must be a list of non-negative integers", name)
        _sampling_check(check_token_ids, name, value)
    return value


def _bounds(spec: Spec, value: float) -> None:
    if spec.bound is not None:
        _sampling_check(spec.bound.check, spec.name, value)


def _sampling_check(check: Any, name: str, value: Any) -> None:
    """A check of sampling_params.py, its SamplingError as the API's 400 naming `name`."""
    try:
        check(name, value)
    except SamplingError as e:
        raise bad_request(str(e), name) from None


def _ids(value: Any) -> list[int] | None:
    """`value` as a list of token ids (integral floats included), or None if it is not one."""
    if not isinstance(value, list):
        return None
    out = []
    for t in value:
        if isinstance(t, float) and t.is_integer():
            t = int(t)
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
            return None
        out.append(t)
    return out


def _prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        ids = _ids(value)
        if ids is not None:
            return [ids]
        lists: list[str | list[int]] = [item for p in value if (item := _ids(p))]
        if len(lists) == len(value):  # every item a non-empty list of ids
            return lists
    raise bad_request(
        "'prompt' must be a string, a non-empty list of strings, a list of token ids or a "
        "list of such lists",
        "prompt",
    )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
