"""POST /tokenize and POST /detokenize, in vLLM's shapes: the model's tokenizer as a service.

    {"prompt": "<text>", "add_special_tokens"?: true}
    {"messages": [...], "add_generation_prompt"?, "continue_final_message"?,
     "chat_template_kwargs"?, "tools"?, "add_special_tokens"?: true}
      -> {"count": n, "max_model_len": m, "tokens": [ids], "token_strs"?: [...]}
    {"tokens": [ids]} -> {"prompt": "<text>"}

The tokens are the ones /v1/completions and /v1/chat/completions would run for the same
prompt or messages (chat through the same template render), so a client can count or
cut a prompt exactly. `model` is optional (checked when given); any other field is a 400
naming it; an id outside the vocabulary is a 400 naming `tokens`. Decoding and checking
the body, the template and the tokenizer run on the router's CPU thread, never on the
event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from libs.common.engine.load.tokenizer import TextTokenizer
from services.router.admission import budget
from services.router.admission.request import light
from services.router.config import RouterConfig
from services.router.errors import bad_request
from services.router.formats.bodies import check_model, closed_object, read
from services.router.formats.openai import chat_template
from services.router.formats.openai.messages import parse_messages
from services.router.requests.prompts import encode, render_chat
from services.router.state import STATE, RouterState
from services.router.structured.limits import GrammarLimits, check_body
from services.router.structured.tools import request as tools

_COMMON = ("model", "add_special_tokens", "return_token_strs")
PROMPT_FIELDS = ("prompt", *_COMMON)
CHAT_FIELDS = ("messages", "tools", *chat_template.FIELDS, *_COMMON)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw, context = await read(request), state.context_len()
    body, text, special, strs = await state.cpu_work(lambda: _checked(state, raw))
    tok = state.tokenizer

    def run() -> bytes:
        source = text()
        if special:  # as the completion endpoints encode it
            ids = encode(tok, source)
        else:
            ids = tok.tokenizer.encode_batch_fast([source], add_special_tokens=False)[0].ids
        out: dict[str, Any] = {"count": len(ids), "max_model_len": context, "tokens": ids}
        if strs:
            out["token_strs"] = [tok.tokenizer.id_to_token(i) for i in ids]
        return orjson.dumps(out)

    async with light(request, body.get("prompt", body.get("messages"))):
        out = await state.cpu_work(run)
    return web.Response(body=out, content_type="application/json")


def _checked(state: RouterState, raw: bytes) -> tuple[dict, Callable[[], str], bool, bool]:
    """/tokenize's body `raw` decoded and checked (on the CPU thread): the body, its text
    to tokenize (a call), add_special_tokens and return_token_strs."""
    fields = tuple({*PROMPT_FIELDS, *CHAT_FIELDS})
    body = closed_object(budget.decoded(raw, state.config), fields, "/tokenize")
    if body.get("model") is not None:
        check_model(state, body["model"])
    check_body({"tools": body.get("tools")}, GrammarLimits.of(state.config))
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    allowed = PROMPT_FIELDS if "prompt" in body else CHAT_FIELDS
    other = sorted(set(body) - set(allowed))
    if other:
        raise bad_request(f"'{other[0]}' does not go with '{allowed[0]}'", other[0])
    special = _flag(body, "add_special_tokens", True)
    strs = _flag(body, "return_token_strs", False)
    return body, _text(state.tokenizer, body, state.config), special, strs


def _text(tok: TextTokenizer, body: dict[str, Any], config: RouterConfig) -> Callable[[], str]:
    """The checked body's text to tokenize, as a call to make off the event loop (a chat
    template's render is CPU work)."""
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        return lambda: prompt
    messages = parse_messages(body["messages"])
    budget.check_messages(messages, config)
    tools.check_tool_messages(body["messages"])
    template = chat_template.template_args(body, messages)
    offered = tools.parse_tools({"tools": body.get("tools")})
    return lambda: render_chat(tok, messages, offered, template)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await read(request)

    def checked() -> list[int]:
        body = closed_object(budget.decoded(raw, state.config), ("model", "tokens"),
                             "/detokenize")  # fmt: skip
        if body.get("model") is not None:
            check_model(state, body["model"])
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise bad_request("'tokens' must be a list of token ids", "tokens")
        vocab = state.tokenizer.vocab_size
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise bad_request(f"token id {outside} is outside the vocabulary (0..{vocab - 1})",
                              "tokens")  # fmt: skip
        return ids

    ids = await state.cpu_work(checked)
    # Special tokens kept: detokenize(tokenize(x)) gives x back, BOS and all.
    async with light(request, ids):
        out = await state.cpu_work(
            lambda: orjson.dumps({"prompt": state.tokenizer.decode(ids, False)})
        )
    return web.Response(body=out, content_type="application/json")


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value
