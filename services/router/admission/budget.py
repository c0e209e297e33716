"""A request's budget, checked before admission: what one request may ask of the router
and of the workers, each limit a RouterConfig flag (docs/api.md, "Limits").

    body        bytes, from Content-Length before anything is read (413); a chunked body
                is cut at the same size by aiohttp's client_max_size (api/app.py)
    items       the body's JSON items (commas), as it is read (formats/bodies.py, `read`)
    raw         the decoded body's top-level lists and strings (`prompt`, `messages`,
                `input`, `tokens`), before the validation walks them (400)
    check       a parsed request: prompt characters and token ids, messages, and the work
                it asks for: prompts x n x max_tokens, and that x (1 + top logprobs) (400)

Each check costs O(1) on a size already known, or O(k) in a count an earlier check
bounded (the characters of the messages, after their number): microseconds, whatever the
client sent. Every refusal names the parameter, the limit and its flag.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.router.config import RouterConfig
from services.router.errors import bad_request, too_large
from services.router.formats.bodies import decode
from services.router.formats.openai.validation import ApiRequest


def body_size(request: web.Request, config: RouterConfig) -> None:
    """A 413 when the body's declared length is over --max-body-bytes: refused before a
    byte of it is read."""
    declared = request.content_length
    if declared is not None and declared > config.max_body_bytes:
        raise too_large(f"{request.method} {request.path}", config.max_body_bytes)


def decoded(raw_body: bytes, config: RouterConfig) -> Any:
    """`raw_body` (as formats/bodies.py's `read` returns it) decoded and checked by `raw`."""
    return raw(decode(raw_body), config)


def raw(body: Any, config: RouterConfig) -> Any:
    """`body` (decoded JSON) once its top-level prompt fields are within the limits, O(1):
    a flat list of ids within --max-prompt-ids, a list of prompts within --max-n."""
    if not isinstance(body, dict):
        return body  # the parser refuses it
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            _chars(len(value), name, config)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > config.max_n:  # each prompt is at least one choice
            raise bad_request(
                f"'prompt' holds {len(prompt)} prompts, over this server's limit of "
                f"{config.max_n} per request (--max-n)",
                "prompt",
            )
    elif isinstance(prompt, list):
        _ids(len(prompt), "prompt", config)
    if isinstance(body.get("tokens"), list):
        _ids(len(body["tokens"]), "tokens", config)
    for name in ("messages", "input"):
        if isinstance(body.get(name), list):
            _messages(len(body[name]), name, config)
    return body


def check(api: ApiRequest, config: RouterConfig, context_len: int) -> None:
    """A parsed request within every limit: its prompts (`prompt_sizes`) and the work it
    asks for. An unset max_tokens counts as `context_len`, the most it can become."""
    prompt_sizes(api, config)
    choices = max(1, len(api.prompts)) * api.n
    max_tokens = context_len if api.max_tokens is None else api.max_tokens
    tokens = choices * max_tokens
    if tokens > config.max_generated_tokens:
        raise bad_request(
            f"'max_tokens': {_choices(api)} x max_tokens {max_tokens} asks for {tokens} "
            f"tokens, over this server's limit of {config.max_generated_tokens} per request "
            "(--max-generated-tokens); lower 'max_tokens' or 'n'",
            "max_tokens",
        )
    if api.logprobs is not None:
        values = tokens * (1 + api.logprobs)
        param = "top_logprobs" if api.endpoint == "chat" else "logprobs"
        if values > config.max_logprob_values:
            raise bad_request(
                f"'{param}': {_choices(api)} x max_tokens {max_tokens} x (1 + {param} "
                f"{api.logprobs}) is {values} logprob values, over this server's limit of "
                f"{config.max_logprob_values} per request (--max-logprob-values)",
                param,
            )


def prompt_sizes(api: ApiRequest, config: RouterConfig) -> None:
    """The request's messages, prompt characters and prompt token ids within the limits."""
    check_messages(api.messages, config)
    chars = sum(len(p) for p in api.prompts if isinstance(p, str))
    _chars(chars, "prompt", config)
    _ids(sum(len(p) for p in api.prompts if isinstance(p, list)), "prompt", config)


def check_messages(messages: list[dict[str, Any]], config: RouterConfig) -> None:
    """Checked messages (string contents) within --max-messages and --max-prompt-chars."""
    _messages(len(messages), "messages", config)
    chars = sum(len(c) for m in messages if isinstance(c := m.get("content"), str))
    _chars(chars, "messages", config)


def check_text(text: str, param: str, config: RouterConfig) -> None:
    _chars(len(text), param, config)


def _chars(n: int, param: str, config: RouterConfig) -> None:
    _over(n, "characters", "max_prompt_chars", param, config)


def _ids(n: int, param: str, config: RouterConfig) -> None:
    _over(n, "token ids", "max_prompt_ids", param, config)


def _messages(n: int, param: str, config: RouterConfig) -> None:
    _over(n, "messages", "max_messages", param, config)


def _over(n: int, what: str, flag: str, param: str, config: RouterConfig) -> None:
    """A 400 naming `param` when `n` is over the flag's limit (`flag`: its config field)."""
    limit = getattr(config, flag)
    if n > limit:
        raise bad_request(
            f"'{param}' holds {n} {what}, over this server's limit of {limit} per request "
            f"(--{flag.replace('_', '-')})",
            param,
        )


def _choices(api: ApiRequest) -> str:
    prompts = len(api.prompts)
    return f"{prompts} prompts x n {api.n}" if prompts > 1 else f"n {api.n}"
