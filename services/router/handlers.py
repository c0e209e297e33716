"""POST /v1/completions and /v1/chat/completions: validate, tokenize, admit, generate.

Each choice (prompt x n) is one request on the workers, with id `<rid>` (or `<rid>-<i>`
when there are several); their outputs are merged into one response, or one SSE stream.
A stream's events are formatted and written inside the bus's callback for their chunk
(`on_delta` below, `SseStream`): the handler itself only waits for the choices to end.
Leaving for any reason (the client went away, an error in one choice) cancels the
choices still running, and each sends `CancelRequest` to the workers.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import orjson
from aiohttp import web

from libs.common.log import get_logger
from services.router import openai_format as fmt
from services.router.errors import ApiError, bad_request, no_workers
from services.router.generation import Choices, Delta, Prompt, prepare, run_all, run_choice
from services.router.state import STATE, RouterState
from services.router.streaming import DONE, SseStream, sse
from services.router.validation import ApiRequest, parse_request

log = get_logger(__name__)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, endpoint: str) -> web.StreamResponse:
    state = request.app[STATE]
    rid: str = request["request_id"]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    api = parse_request(endpoint, body, state.config.max_n)
    if api.model not in (state.config.model_name, state.model_id):
        raise ApiError(
            404,
            f"The model '{api.model}' does not exist; this server serves "
            f"'{state.config.model_name}'.",
            param="model",
            code="model_not_found",
        )
    prompts = prepare(api, state.tokenizer, state.context_len())
    if state.pending >= state.config.max_pending:
        raise ApiError(
            429,
            f"the router is at its bound of {state.config.max_pending} requests in flight",
            code="too_many_requests",
            headers={"Retry-After": "1"},
        )
    if not state.selector.eligible("decode"):
        raise no_workers("no decode worker is live; retry shortly")
    state.pending += 1
    state.metrics.running.labels(state.metrics.model).inc()
    arrived = request["arrived"]
    try:
        choices = _choices(state, rid, api, prompts, arrived)
        prefix = "chatcmpl-" if endpoint == "chat" else "cmpl-"
        if api.stream:
            return await _stream(request, state, prefix + rid, api, prompts, choices)
        return await _collect(state, prefix + rid, api, prompts, choices)
    finally:
        state.pending -= 1
        state.metrics.running.labels(state.metrics.model).dec()
        state.metrics.e2e.labels(state.metrics.model).observe(time.monotonic() - arrived)


def _choices(state: RouterState, rid: str, api: ApiRequest, prompts: list[Prompt], arrived):
    """One runner per choice: `runner(on_delta)` is the coroutine that generates it."""
    choices: Choices = []
    total = len(prompts) * api.n
    for p, prompt in enumerate(prompts):
        for j in range(api.n):
            index = p * api.n + j
            seed = prompt.sampling.seed
            sampling = prompt.sampling
            if seed is not None and j:  # n samples with one seed must still differ
                sampling = dataclasses.replace(sampling, seed=(seed + j) % 2**63)
            choice = Prompt(prompt.token_ids, prompt.text, sampling)
            sub_id = rid if total == 1 else f"{rid}-{index}"

            def runner(on_delta, sub_id=sub_id, index=index, p=p, choice=choice):
                return run_choice(
                    state.dispatcher, state.selector, state.metrics, sub_id, index, p, choice,
                    arrived, state.config.generate_timeout, on_delta,
                )  # fmt: skip

            choices.append(runner)
    return choices


class _Tally:
    """Usage and per-choice state while deltas arrive."""

    def __init__(self, state: RouterState, api: ApiRequest, prompts: list[Prompt]):
        self.state, self.api, self.prompts = state, api, prompts
        self.totals = fmt.Totals(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        n = len(prompts) * api.n
        self.choices = [fmt.Choice(i) for i in range(n)]
        self.offsets = [0] * n  # text offset per choice, for completions logprobs

    def add(self, d: Delta) -> None:
        c = self.choices[d.index]
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            self.totals.completion_tokens += d.completion_tokens
            prompt_len = len(self.prompts[d.prompt].token_ids)
            if d.index % self.api.n == 0:  # a prompt counts once, as OpenAI bills it
                self.totals.cached_tokens += min(prompt_len, sum(d.cached.values()))
            self.state.metrics.finished(d.finish_reason, prompt_len, d.completion_tokens, d.cached)

    def logprobs(self, index: int, entries: list[dict[str, Any]], text: str) -> Any:
        if self.api.logprobs is None:
            return None
        if self.api.endpoint == "chat":
            return fmt.chat_logprobs(entries, self.state.token_text)
        out = fmt.completion_logprobs(entries, self.state.token_text, self.offsets[index])
        self.offsets[index] += len(text)
        return out


async def _collect(state, rid, api, prompts, choices: Choices) -> web.Response:
    tally = _Tally(state, api, prompts)
    await run_all(choices, tally.add)
    model, created = api.model, int(time.time())
    if api.endpoint == "chat":
        choices = [
            fmt.chat_choice(c, tally.logprobs(c.index, c.logprobs, c.text)) for c in tally.choices
        ]
        body = fmt.chat_body(rid, created, model, choices, tally.totals)
    else:
        choices = []
        for c in tally.choices:
            if api.echo:
                echoed = prompts[c.index // api.n].text
                tally.offsets[c.index] = len(echoed)
                c.text = echoed + c.text
            choices.append(fmt.completion_choice(c, tally.logprobs(c.index, c.logprobs, c.text)))
        body = fmt.completion_body(rid, created, model, choices, tally.totals)
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def _stream(request, state, rid, api, prompts, choices: Choices) -> web.StreamResponse:
    tally = _Tally(state, api, prompts)
    created, chat = int(time.time()), api.endpoint == "chat"
    chunk = fmt.chat_chunk if chat else fmt.completion_chunk
    out = SseStream(request, {"x-request-id": request["request_id"]})
    started: set[int] = set()

    def on_delta(d: Delta) -> None:  # in the bus's callback: formats and writes, never awaits
        tally.add(d)
        events = _events(d, api, prompts, tally, started)
        # One write per delta (a send is a syscall that wakes the client).
        out.send(b"".join(sse(chunk(rid, created, api.model, [e], None)) for e in events))

    tail = [DONE]  # the last events go out with the end of the body: one send
    try:
        await run_all(choices, on_delta)
        if api.include_usage:
            tail.insert(0, sse(chunk(rid, created, api.model, [], tally.totals)))
    except ApiError as e:
        # Until the first output the HTTP status is still free: an error there (no room,
        # no worker) is a plain 429/503 response, not an event inside a 200 stream.
        if not out.started:
            raise
        log.warning("stream ended by an error", status=e.status, error=e.message)
        state.metrics.failure.labels(state.metrics.model, str(e.status)).inc()
        tail.insert(0, sse(e.body()))
    return await out.finish(b"".join(tail))


def _events(d: Delta, api: ApiRequest, prompts, tally: _Tally, started: set[int]) -> list:
    """The stream events of one delta: a choice's opening event first, then its text."""
    chat, events = api.endpoint == "chat", []
    if d.index not in started:
        started.add(d.index)
        if chat:
            role = {"role": "assistant", "content": ""}
            events.append(fmt.chat_delta(d.index, role, None, None))
        elif api.echo:
            echoed = prompts[d.prompt].text
            tally.offsets[d.index] = len(echoed)
            events.append(fmt.completion_delta(d.index, echoed, None, None))
    lp = tally.logprobs(d.index, d.logprobs, d.text)
    if chat:
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        events.append(fmt.chat_delta(d.index, delta, lp, d.finish_reason))
    else:
        events.append(fmt.completion_delta(d.index, d.text, lp, d.finish_reason))
    return events
