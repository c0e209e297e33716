"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A Messages body becomes the chat ApiRequest (formats/anthropic/request.py) and runs
through lifecycle.run_request like /v1/chat/completions (admission, routing, PD,
migration, grammars are the same); only the response is written in Anthropic's shape
(formats/anthropic/shapes.py): one message (`collect`) or its events (`stream`):

    message_start, then per content block (thinking for a reasoning model's thinking,
    text, or tool_use read out of the text as the chat path reads tool calls):
    content_block_start, content_block_delta (thinking_delta / text_delta /
    input_json_delta), content_block_stop; then message_delta (stop_reason, stop_sequence,
    usage) and message_stop. An error after the stream started is an
    `error` event.

Errors on these paths have Anthropic's shape (api/app.py asks shapes.error_body).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from services.router.admission import budget
from services.router.admission.request import light
from services.router.errors import ApiError
from services.router.formats.anthropic import request as anthropic
from services.router.formats.anthropic import shapes
from services.router.formats.bodies import check_model, parsed
from services.router.formats.openai import shapes as fmt
from services.router.formats.openai.validation import ApiRequest
from services.router.formats.sse import SseStream
from services.router.requests import lifecycle
from services.router.requests.chat_text import ChatText, message_parts
from services.router.requests.lifecycle import Choice, Delta, Tally
from services.router.requests.prompts import encode, render_chat
from services.router.state import STATE, RouterState
from services.router.structured.limits import GrammarLimits, check_body


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    api = await _parsed(request, state, "/v1/messages")
    await lifecycle.check(api, state)
    return await lifecycle.run_request(request, api, "msg_", stream if api.stream else collect)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages would run it (chat template and tools
    included), without running it."""
    state = request.app[STATE]
    api = await _parsed(request, state, "/v1/messages/count_tokens")
    budget.prompt_sizes(api, state.config)
    check_model(state, api.model)

    def count() -> int:  # template and tokenizer: CPU, off the loop
        text = render_chat(state.tokenizer, api.messages, api.tools, api.template)
        return len(encode(state.tokenizer, text))

    async with light(request, api.messages):
        return web.json_response({"input_tokens": await state.cpu_work(count)})


async def _parsed(request: web.Request, state: RouterState, path: str) -> ApiRequest:
    """The body as the chat ApiRequest, its tools counted against --max-tools and its
    prompt fields against the budget before they are read (off the loop when large)."""
    config, limits = state.config, GrammarLimits.of(state.config)

    def checked(body: Any) -> ApiRequest:
        check_body(body, limits)
        return anthropic.parse(budget.raw(body, config), path)

    return await parsed(request, checked)


async def collect(request: web.Request, tally: Tally, choices: list[Choice]) -> web.Response:
    """Run the one choice, then answer with the message."""
    await lifecycle.dispatch(tally.state, choices, tally.add)
    c = tally.choices[0]
    parts = message_parts(c.text, c.finish_reason, tally.tools, tally.prompts[0].thinks)
    calls = [_tool_use(f["function"]["name"], f["function"]["arguments"]) for f in parts.calls]
    blocks = [shapes.thinking_block(parts.reasoning)] if parts.reasoning else []
    if parts.content or not calls:
        blocks.append(shapes.text_block(parts.content))
    sequence = _stop_sequence(c)
    reason = shapes.stop_reason(c.finish_reason, bool(calls), sequence)
    message = blocks + calls
    body = shapes.message(tally.rid, tally.api.model, message, reason, sequence, _usage(tally))
    return web.json_response(body)


async def stream(request: web.Request, tally: Tally, choices: list[Choice]) -> web.StreamResponse:
    """Run the one choice, writing its events as its output arrives."""
    out = SseStream(request, {"x-request-id": request["request_id"]})
    blocks = StreamedBlocks(tally)

    def on_delta(d: Delta) -> None:  # in the bus's callback: formats and writes, never awaits
        tally.add(d)
        out.send(blocks.events(d))

    try:
        await lifecycle.dispatch(tally.state, choices, on_delta)
        c = tally.choices[0]
        sequence = _stop_sequence(c)
        delta = {
            "stop_reason": shapes.stop_reason(c.finish_reason, blocks.called, sequence),
            "stop_sequence": sequence,
        }
        end = {"delta": delta, "usage": _usage(tally).body()}
        tail = blocks.close() + shapes.event("message_delta", end)
        tail += shapes.event("message_stop", {})
    except ApiError as e:
        lifecycle.stream_failed(tally, out.started, e)
        tail = shapes.event("error", shapes.error_body(e))
    return await out.finish(tail)


class StreamedBlocks:
    """The content blocks of one streamed message: each delta's text -> its events. A
    reasoning model's thinking goes into a thinking block, the answer's text into a text
    block; a tool call (whole, when its block closes in the output) is a tool_use block of
    its own, its input in one input_json_delta."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.parts = ChatText(tally.tools, tally.prompts[0].thinks)
        self.started = False  # message_start sent
        self.next = 0  # the index of the next block
        self.open: str | None = None  # the kind of the open block: thinking or text
        self.called = False
        self.texted = False  # a text block was opened

    def events(self, d: Delta) -> bytes:
        out = []
        if not self.started:
            self.started = True
            usage = shapes.Usage(self.tally.totals.prompt_tokens)
            start = shapes.message(self.tally.rid, self.tally.api.model, [], None, None, usage)
            out.append(shapes.event("message_start", {"message": start}))
        parts = self.parts.feed(d.text, d.finish_reason)
        if parts.reasoning:
            out.append(self._piece("thinking", parts.reasoning))
        if parts.content:
            out.append(self._piece("text", parts.content))
        for call in parts.calls:
            out.append(self._close())
            function = call["function"]
            out.append(self._start(_tool_use(function["name"], "{}")))
            arguments = function["arguments"]
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            out.append(shapes.event("content_block_stop", {"index": self.next - 1}))
            self.called = True
        return b"".join(out)

    def close(self) -> bytes:
        """The events that end the content: the open block's stop (an empty text block
        when the message has no text and no call, as the whole message would hold)."""
        if not (self.called or self.texted):
            return self._close() + self._piece("text", "") + self._close()
        return self._close()

    def _piece(self, kind: str, text: str) -> bytes:
        """`text` into an open block of `kind` (thinking or text), opened here if need be."""
        out = b""
        if self.open != kind:
            out += self._close()
            empty = shapes.thinking_block("") if kind == "thinking" else shapes.text_block("")
            out += self._start(empty)
            self.open = kind
        self.texted = self.texted or kind == "text"
        if not text:
            return out
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {
            "type": "text_delta", "text": text}  # fmt: skip
        return out + self._delta(delta)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return shapes.event("content_block_delta", {"index": self.next - 1, "delta": delta})

    def _start(self, block: dict[str, Any]) -> bytes:
        self.next += 1
        return shapes.event("content_block_start", {"index": self.next - 1, "content_block": block})

    def _close(self) -> bytes:
        """The open block's stop, if one is open."""
        if self.open is None:
            return b""
        self.open = None
        return shapes.event("content_block_stop", {"index": self.next - 1})


def _tool_use(name: str, arguments: str) -> dict[str, Any]:
    return shapes.tool_use_block(shapes.new_id("toolu_"), name, json.loads(arguments))


def _usage(tally: Tally) -> shapes.Usage:
    t = tally.totals
    return shapes.Usage(t.prompt_tokens, t.completion_tokens, t.cached_tokens)


def _stop_sequence(c: fmt.Choice) -> str | None:
    """The stop sequence that ended choice `c`: the stop string the engine reported
    (TokenChunk.stop_reason; a stop token id is not a sequence); None otherwise."""
    if c.finish_reason != "stop" or not isinstance(c.stop_reason, str):
        return None
    return c.stop_reason
