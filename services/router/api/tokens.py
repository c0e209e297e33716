"""POST /tokenize and POST /detokenize, in vLLM's shapes: the model's tokenizer as a service.

    {"prompt": "<text>", "add_special_tokens"?: true}
    {"messages": [...], "add_generation_prompt"?, "continue_final_message"?,
     "chat_template_kwargs"?, "tools"?, "add_special_tokens"?: true}
      -> {"count": n, "max_model_len": m, "tokens": [ids], "token_strs"?: [...]}
    {"tokens": [ids]} -> {"prompt": "<text>"}

The tokens are the ones /v1/completions and /v1/chat/completions would run for the same
prompt or messages (chat through the same template render), so a client can count or
cut a prompt exactly. `model` is optional (checked when given); any other field is a 400
naming it; an id outside the vocabulary is a 400 naming `tokens`. Tokenizer work runs in
a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from libs.common.engine.load.tokenizer import TextTokenizer
from services.router.admission.request import light
from services.router.errors import bad_request
from services.router.formats.bodies import check_model, json_object
from services.router.formats.openai import chat_template
from services.router.formats.openai.messages import parse_messages
from services.router.requests.prompts import encode, render_chat
from services.router.state import STATE
from services.router.structured.limits import GrammarLimits, check_body
from services.router.structured.tools import request as tools

_COMMON = ("model", "add_special_tokens", "return_token_strs")
PROMPT_FIELDS = ("prompt", *_COMMON)
CHAT_FIELDS = ("messages", "tools", *chat_template.FIELDS, *_COMMON)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_object(request, tuple({*PROMPT_FIELDS, *CHAT_FIELDS}), "/tokenize")
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
    text = _text(state.tokenizer, body)
    tok = state.tokenizer

    def run() -> dict[str, Any]:
        source = text()
        if special:  # as the completion endpoints encode it
            ids = encode(tok, source)
        else:
            ids = tok.tokenizer.encode_batch_fast([source], add_special_tokens=False)[0].ids
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.context_len(),
                               "tokens": ids}  # fmt: skip
        if strs:
            out["token_strs"] = [tok.tokenizer.id_to_token(i) for i in ids]
        return out

    async with light(request, body.get("prompt", body.get("messages"))):
        return web.json_response(await asyncio.to_thread(run))


def _text(tok: TextTokenizer, body: dict[str, Any]) -> Callable[[], str]:
    """The checked body's text to tokenize, as a call to make off the event loop (a chat
    template's render is CPU work)."""
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        return lambda: prompt
    messages = parse_messages(body["messages"])
    tools.check_tool_messages(body["messages"])
    template = chat_template.template_args(body, messages)
    offered = tools.parse_tools({"tools": body.get("tools")})
    return lambda: render_chat(tok, messages, offered, template)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_object(request, ("model", "tokens"), "/detokenize")
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
    # Special tokens kept: detokenize(tokenize(x)) gives x back, BOS and all.
    async with light(request, ids):
        text = await asyncio.to_thread(state.tokenizer.decode, ids, False)
    return web.json_response({"prompt": text})


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value
