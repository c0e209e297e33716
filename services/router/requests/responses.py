"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../{id}/input_items:
OpenAI's Responses API on the request life every format shares (lifecycle.run_request:
admit, prompts, choices, dispatch through PD, migration and grammars).

  1. parse     the body against the closed table (formats/responses/request.py); the
               conversation of `previous_response_id` read from the store (stored.py);
               the whole as a chat ApiRequest, its grammar and tools checked (lifecycle.check)
  2-5.         lifecycle.run_request, one choice
  6. respond   collect: one response object; stream: the typed events
               (formats/responses/events.py), the first ones with the first output, so
               an error before it is still a plain 4xx/5xx
  7. store     with `store` (the default) the response and its conversation are written
               to the bucket before the client gets the end of it, so a next request may
               name it at once, through any router
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from libs.common.messages.responses import StoredResponse
from services.router.admission import budget
from services.router.admission.request import light
from services.router.errors import ApiError, bad_request
from services.router.formats.bodies import off_loop, parsed
from services.router.formats.responses import shapes
from services.router.formats.responses.events import ResponseEvents, encode
from services.router.formats.responses.request import (
    ResponsesRequest,
    previous_not_found,
    read_body,
    renamed,
    to_api,
    valid_response_id,
)
from services.router.formats.sse import SseStream
from services.router.requests import lifecycle
from services.router.requests.lifecycle import Choice, Delta, Tally
from services.router.requests.stored import ResponseStore
from services.router.state import STATE
from services.router.structured.limits import GrammarLimits, check_body

STORE: web.AppKey[ResponseStore] = web.AppKey("responses_store", ResponseStore)


async def create(request: web.Request) -> web.StreamResponse:
    state, store = request.app[STATE], request.app[STORE]
    config, limits = state.config, GrammarLimits.of(state.config)

    def checked(body: Any) -> ResponsesRequest:
        check_body(body, limits)
        return read_body(budget.raw(body, config))

    req = await parsed(request, checked)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = await store.get(req.previous_response_id)
        if previous is None:
            raise previous_not_found(req.previous_response_id)
        history = previous.messages
    with renamed():
        # A stored conversation counts as 1 KiB a message: a long one is checked in a thread.
        size = (request.content_length or 0) + (len(history) << 10)
        api = await off_loop(size, lambda: to_api(req, history, state.config.max_n), state.cpu)
        await lifecycle.check(api, state)
        run = Run(req, store, history)
        return await lifecycle.run_request(request, api, "resp_",
                                           run.stream if req.stream else run.collect)  # fmt: skip


async def retrieve(request: web.Request) -> web.Response:
    stored = await _stored(request)
    return web.json_response(stored.body, dumps=lambda o: orjson.dumps(o).decode())


async def list_input_items(request: web.Request) -> web.Response:
    """A stored response's input items, OpenAI's list page: `order` (desc, the default, or
    asc), `limit` (1 to 100, 20), `after` (an item id); any other query key is a 400."""
    query = request.query
    unknown = sorted(set(query) - {"order", "limit", "after"})
    if unknown:
        raise bad_request(f"'{unknown[0]}' is not a parameter of input_items", unknown[0])
    order, limit = query.get("order", "desc"), query.get("limit", "20")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", "order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise bad_request("'limit' must be an integer from 1 to 100", "limit")
    items = (await _stored(request)).input_items
    items = items if order == "asc" else items[::-1]
    ids = [i["id"] for i in items]
    after = query.get("after")
    if after is not None and after not in ids:
        raise bad_request(f"'after': no input item {after!r} in this response", "after")
    start = ids.index(after) + 1 if after is not None else 0
    page = items[start : start + int(limit)]
    body = {"object": "list", "data": page, "has_more": start + len(page) < len(items),
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}  # fmt: skip
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    store = request.app[STORE]
    if not valid_response_id(response_id):
        raise _not_found(response_id)
    async with light(request, None):  # the tenant's rate and concurrency
        deleted = await store.delete(response_id)
    if not deleted:
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    stored = None
    if valid_response_id(response_id):
        async with light(request, None):  # the tenant's rate and concurrency
            stored = await request.app[STORE].get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")  # fmt: skip


class Run:
    """One response's run: `collect` or `stream` (lifecycle's `respond`), then `save`."""

    def __init__(self, req: ResponsesRequest, store: ResponseStore, history: list[dict]):
        self.req, self.store, self.history = req, store, history
        self.id, self.created = shapes.new_id("resp"), int(time.time())

    async def collect(
        self, request: web.Request, tally: Tally, choices: list[Choice]
    ) -> web.StreamResponse:
        await lifecycle.dispatch(tally.state, choices, tally.add)
        c = tally.choices[0]
        status = _status(c.finish_reason)
        # The text's parts as chat reads them (chat_text.py): a call cut by
        # max_output_tokens is dropped, markup too; a reasoning model's thinking is left out.
        parts = tally.texts[0].whole(c.text, c.finish_reason)
        content, calls = parts.content, parts.calls
        output = []
        if content or not calls:
            lp = None  # unless asked (no tools then); formatted in a thread: entries x top
            if tally.api.logprobs is not None:
                lp = await tally.state.cpu_work(lambda: tally.logprobs(0, c.logprobs, c.text))
            item_id = shapes.new_id("msg")
            output.append(shapes.message_item(item_id, content, status, lp and lp["content"]))
        for call in calls:
            output.append(shapes.call_item(shapes.new_id("fc"), call, "completed"))
        body = shapes.response_body(self.id, self.created, self.req, output, status)
        body["usage"] = shapes.usage(tally.totals)
        await self.save(body)
        return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())

    async def stream(
        self, request: web.Request, tally: Tally, choices: list[Choice]
    ) -> web.StreamResponse:
        out = SseStream(request, {"x-request-id": request["request_id"]})
        events = ResponseEvents()
        text = tally.texts[0]  # the output's parts, as chat reads them (chat_text.py)

        def on_delta(d: Delta) -> None:  # in the bus's callback: formats and writes
            tally.add(d)
            sent = [] if out.started else events.start(self.body([], "in_progress"))
            parts = text.feed(d.text, d.finish_reason)
            lp = tally.logprobs(0, d.logprobs, d.text)  # None unless asked (no tools then)
            sent += events.text(parts.content, lp and lp["content"])
            for delta in parts.calls:
                sent += events.call(delta)
            out.send(encode(sent))

        try:
            await lifecycle.dispatch(tally.state, choices, on_delta)
            body = self.body([], _status(tally.choices[0].finish_reason))
            body["usage"] = shapes.usage(tally.totals)
            tail = events.finish(body)
            await self.save(body)
        except ApiError as e:
            lifecycle.stream_failed(tally, out.started, e)
            error = {"code": e.code or str(e.status), "message": e.message}
            tail = events.failed(self.body([], "in_progress"), error)
        return await out.finish(encode(tail))

    def body(self, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
        return shapes.response_body(self.id, self.created, self.req, output, status)

    async def save(self, body: dict[str, Any]) -> None:
        """Store the response (with `store`); its body says `store: false` when it could
        not be."""
        if not self.req.store:
            return
        messages = [*self.history, *self.req.input, *shapes.chat_output(body["output"])]
        items = shapes.input_items(self.req.input)
        record = StoredResponse(self.id, float(self.created), messages, body, items)
        body["store"] = await self.store.put(record)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
