"""One request's life in the router: POST /v1/completions and /v1/chat/completions.

Read top to bottom, in the order a request lives it:

  1. parse     the JSON body -> a validated `ApiRequest` (validation.py); the model name;
               a grammar (response_format, regex, ebnf, forced tools) compiled (output.py)
  2. admit     through the tenant's queue to a free worker slot, or 429/503 at once,
               before any costly work (admission/request.py, gate.py)
  3. prompts   tokenized (in a thread: never on the event loop), checked against the
               context, given their sampling (prompts.py)
  4. choices   prompt x n: one `Choice` each, with id `<rid>` (or `<rid>-<i>` when several);
               `<rid>` is router-local (`RouterState.new_request_id`): the client's
               X-Request-Id is a label (echoed, logged, sent along for workers' logs)
  5. dispatch  every choice routed (routing/selector.py) and run on the workers (dispatch.py); its
               TokenChunks become `Delta`s, observed by the latency metrics
  6. stream or collect  each Delta added up in the request's Tally (tally.py), formatted
               and written as SSE events at once, inside the bus's callback for its chunk
               (it never awaits); or merged into one body; a chat choice's text split into
               its message's parts (chat_text.py)

Leaving for any reason (the client went away, an error in one choice) cancels the choices
still running, and each sends `CancelRequest` to the workers.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
from aiohttp import web

from libs.common import tracing
from libs.common.log import get_logger, request_context
from libs.common.messages.control import SamplingSpec, TokenChunk
from services.router.admission import budget
from services.router.admission.gate import GATE
from services.router.admission.request import admit
from services.router.errors import ApiError
from services.router.formats.bodies import check_model, parsed
from services.router.formats.openai import shapes as fmt
from services.router.formats.openai.validation import ApiRequest, parse_request
from services.router.formats.sse import DONE, SseStream, sse
from services.router.requests.prompts import Prompt, prepare
from services.router.requests.tally import Delta, Tally
from services.router.state import STATE, RouterState
from services.router.structured import output as structured
from services.router.structured.limits import GrammarLimits, check_body
from services.router.structured.tools.grammar import check_tool_grammar

log = get_logger(__name__)


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, "chat")


async def serve(request: web.Request, endpoint: str) -> web.StreamResponse:
    """The whole request; each step is one call, defined below in this order."""
    state = request.app[STATE]
    with tracing.span("router.parse", request["request_id"]):
        api = await parse(request, endpoint, state)
    prefix = "chatcmpl-" if endpoint == "chat" else "cmpl-"
    return await run_request(request, api, prefix, stream if api.stream else collect)


Respond = Callable[[web.Request, "Tally", list["Choice"]], Awaitable[web.StreamResponse]]


async def run_request(
    request: web.Request, api: ApiRequest, id_prefix: str, respond: Respond
) -> web.StreamResponse:
    """Steps 2 to 6 for a checked ApiRequest of any API format (OpenAI's here, the
    Responses and Messages formats beside it): admit, prompts, choices, then `respond`
    runs the choices (`dispatch`) and writes the response in its format."""
    state = request.app[STATE]
    arrived, label, rid = request["arrived"], request["request_id"], state.new_request_id()
    with tracing.span("router.admit", label):
        ticket = await admit(request, api, state.context_len())
    tally: Tally | None = None
    state.pending += 1
    state.metrics.running.labels(state.metrics.model).inc()
    try:
        with request_context(label, wire_id=rid):
            if api.user:  # user (OpenAI), metadata.user_id (Anthropic): for the operator
                log.info("request from end user", user=api.user[:256])
            # On the router's CPU threads (--cpu-threads): the template holds the GIL, and
            # tokenizers more than the cores contend with the loop for the CPU.
            context, defaults = state.context_len(), state.sampling_defaults
            with tracing.span("router.prompts", label):
                prompts = await state.cpu_work(
                    lambda: prepare(api, state.tokenizer, context, defaults)
                )
            choices = make_choices(rid, api, prompts, arrived, label)
            tally = Tally(state, api, prompts, id_prefix + label)
            with tracing.span("router.respond", label, wire_id=rid, stream=api.stream):
                return await respond(request, tally, choices)
    finally:  # every way out (an error, a cancel, the client gone) gives the slot back
        totals = tally.running_totals() if tally else None  # a cancelled one's tokens too
        used = totals.prompt_tokens + totals.completion_tokens if totals else 0
        request.app[GATE].leave(ticket, used, totals.completion_tokens if totals else 0)
        state.pending -= 1
        state.metrics.running.labels(state.metrics.model).dec()
        state.metrics.e2e.labels(state.metrics.model).observe(time.monotonic() - arrived)


# --- 1. parse ----------------------------------------------------------------------------


async def parse(request: web.Request, endpoint: str, state: RouterState) -> ApiRequest:
    """The body as an ApiRequest for a model this router serves; 400 or 404 otherwise."""
    config, limits = state.config, GrammarLimits.of(state.config)

    def checked(body: Any) -> ApiRequest:
        check_body(body, limits)
        return parse_request(endpoint, budget.raw(body, config), config.max_n)

    api = await parsed(request, checked)
    await check(api, state)
    return api


async def check(api: ApiRequest, state: RouterState) -> None:
    """The model and the grammars of a parsed request, in whichever format it came; the
    grammar's text goes into its sampling."""
    budget.check(api, state.config, state.context_len())
    check_model(state, api.model)
    # Grammars are built and compiled in the grammar pool (a deadline, a cache by content);
    # the tools' schemas compile even under "auto", so a schema that cannot be enforced is
    # a 400 in every mode.
    limits = GrammarLimits.of(state.config)
    forced = None
    if api.tools is not None:
        forced = await check_tool_grammar(api.tools, state.grammars, limits)
    if api.grammar is not None and api.grammar.kind == "tools":
        api.sampling["grammar"] = forced
    elif api.grammar is not None:
        api.sampling["grammar"] = await structured.check(api.grammar, state.grammars, limits)


# --- 2. admit: admit() in services/router/admission/request.py --------------------------
# --- 3. prompts: prepare() in services/router/requests/prompts.py ------------------------
# --- 4. choices --------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One output of a request: sample `index % n` of prompt `prompt`, run on the workers
    as `request_id` (router-local). `arrived` is when the HTTP request came (where TTFT
    starts); `label` the client's X-Request-Id, for the workers' logs."""

    request_id: str
    index: int
    prompt: int
    token_ids: list[int]
    sampling: SamplingSpec
    arrived: float
    label: str = ""


def make_choices(
    rid: str, api: ApiRequest, prompts: list[Prompt], arrived: float, label: str = ""
) -> list[Choice]:
    choices = []
    total = len(prompts) * api.n
    for p, prompt in enumerate(prompts):
        for j in range(api.n):
            index = p * api.n + j
            sampling = prompt.sampling
            if sampling.seed is not None and j:  # n samples with one seed must still differ
                sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + j) % 2**63)
            sub_id = rid if total == 1 else f"{rid}-{index}"
            choices.append(Choice(sub_id, index, p, prompt.token_ids, sampling, arrived, label))
    return choices


# --- 5. dispatch: each choice's output as Deltas (tally.py) ------------------------------


OnDelta = Callable[[Delta], None]


async def dispatch(state: RouterState, choices: list[Choice], on_delta: OnDelta) -> None:
    """Every choice to its end, its Deltas to `on_delta`. Raises ApiError when a choice
    fails, or what `on_delta` raised (the stream stops there)."""
    await run_all([functools.partial(run_choice, state, c) for c in choices], on_delta)


async def run_choice(state: RouterState, choice: Choice, on_delta: OnDelta) -> None:
    """One choice: route, dispatch, and hand its Deltas to `on_delta` until it finishes."""
    route = state.selector.plan(choice.token_ids, choice.sampling.cache_salt, choice.label)
    deltas = ChoiceDeltas(state, choice, on_delta)
    timeout = state.config.generate_timeout
    await state.dispatcher.run(
        choice.request_id, choice.token_ids, choice.sampling, route, timeout, deltas.on_chunk,
        label=choice.label,
    )  # fmt: skip


async def run_all(runs: list[Callable[[OnDelta], Awaitable[None]]], on_delta: OnDelta) -> None:
    """Every run to its end; the first failure cancels the others and is raised."""
    if len(runs) == 1:  # the usual request: no task of its own
        await runs[0](on_delta)
        return
    tasks = [asyncio.ensure_future(run(on_delta)) for run in runs]
    try:
        for next_done in asyncio.as_completed(tasks):
            await next_done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ChoiceDeltas:
    """TokenChunks of one choice -> Deltas for `on_delta`, with the TTFT and ITL metrics.
    Called inside the bus's callback for the chunk (dispatch.py): it never awaits."""

    def __init__(self, state: RouterState, choice: Choice, on_delta: OnDelta):
        metrics = state.metrics
        self.index, self.prompt, self.arrived = choice.index, choice.prompt, choice.arrived
        self.on_delta = on_delta
        self.ttft = metrics.ttft.labels(metrics.model)
        self.itl = metrics.itl.labels(metrics.model)
        self.last: float | None = None
        self.produced = 0

    def on_chunk(self, chunk: TokenChunk) -> None:
        n = len(chunk.token_ids)
        if n:
            now = time.monotonic()
            if self.last is None:
                self.ttft.observe(now - self.arrived)
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    self.itl.observe(gap)
            self.last = now
        self.produced += n
        delta = Delta(self.index, self.prompt, chunk.text, chunk.token_ids, chunk.logprobs)
        delta.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            delta.finish_reason, delta.stop_reason = chunk.finish_reason, chunk.stop_reason
            usage = chunk.usage
            delta.completion_tokens = usage.completion_tokens if usage else self.produced
            delta.cached = dict(usage.cached_tokens) if usage else {}
        self.on_delta(delta)


# --- 6. stream or collect: each Delta into the request's Tally (tally.py) -----------------


async def collect(request: web.Request, tally: Tally, choices: list[Choice]) -> web.Response:
    """Run every choice, then answer with one JSON body: formatted in a thread when it
    holds logprobs (up to --max-logprob-values entries, each a token's text)."""
    await dispatch(tally.state, choices, tally.add)
    api = tally.api
    heavy = api.logprobs is not None or api.vllm.prompt_logprobs is not None
    body = await tally.state.cpu_work(lambda: collected(tally)) if heavy else collected(tally)
    return web.Response(body=body, content_type="application/json")


def collected(tally: Tally) -> bytes:
    """The JSON body of a request whose choices have all finished."""
    api, prompts = tally.api, tally.prompts
    model, created = api.model, int(time.time())
    if api.endpoint == "chat":
        out = [
            tally.texts[c.index].choice(c, tally.logprobs(c.index, c.logprobs, c.text))
            | tally.vllm.choice(c)
            for c in tally.choices
        ]
        body = fmt.chat_body(tally.rid, created, model, out, tally.totals) | tally.vllm.body()
    else:
        out = []
        for c in tally.choices:
            if api.echo:
                echoed = prompts[c.index // api.n].text
                tally.offsets[c.index] = len(echoed)
                c.text = echoed + c.text
            lp = tally.logprobs(c.index, c.logprobs, c.text)
            lp = fmt.joined_logprobs(tally.prompt_lps.get(c.index), lp)
            out.append(fmt.completion_choice(c, lp) | tally.vllm.choice(c))
        body = fmt.completion_body(tally.rid, created, model, out, tally.totals)
    return orjson.dumps(body)


async def stream(request: web.Request, tally: Tally, choices: list[Choice]) -> web.StreamResponse:
    """Run every choice, writing each Delta's SSE events as it arrives."""
    api, rid = tally.api, tally.rid
    created, chat = int(time.time()), api.endpoint == "chat"
    chunk = fmt.chat_chunk if chat else fmt.completion_chunk
    out = SseStream(request, {"x-request-id": request["request_id"]})
    started: set[int] = set()

    def on_delta(d: Delta) -> None:  # in the bus's callback: formats and writes, never awaits
        tally.add(d)
        events = _events(d, tally, started)
        usage = tally.running_totals() if api.vllm.continuous_usage else None
        # One write per delta (a send is a syscall that wakes the client).
        bodies = (tally.vllm.lift(chunk(rid, created, api.model, [e], usage)) for e in events)
        out.send(b"".join(sse(body) for body in bodies))

    tail = [DONE]  # the last events go out with the end of the body: one send
    try:
        await dispatch(tally.state, choices, on_delta)
        if api.include_usage:
            tail.insert(0, sse(chunk(rid, created, api.model, [], tally.totals)))
    except ApiError as e:
        stream_failed(tally, out.started, e)
        tail.insert(0, sse(e.body()))
    return await out.finish(b"".join(tail))


def stream_failed(tally: Tally, started: bool, e: ApiError) -> None:
    """An error while a response streams, in any API format. Until the first output the
    HTTP status is still free: an error there (no room, no worker) is raised again, a plain
    429/503 response rather than an event inside a 200 stream. After it: logged and
    counted here, and the caller ends the stream with it in its own format."""
    if not started:
        raise e
    log.warning("stream ended by an error", status=e.status, error=e.message)
    metrics = tally.state.metrics
    metrics.failure.labels(metrics.model, str(e.status)).inc()


def _events(d: Delta, tally: Tally, started: set[int]) -> list:
    """The stream events of one delta: a choice's opening event first, then its text."""
    api = tally.api
    chat, events = api.endpoint == "chat", []
    if d.index not in started:
        started.add(d.index)
        if chat:
            role = {"role": "assistant", "content": ""}
            events.append(fmt.chat_delta(d.index, role, None, None))
        elif api.echo:
            echoed = tally.prompts[d.prompt].text
            tally.offsets[d.index] = len(echoed)
            scored = tally.prompt_lps.get(d.index)
            events.append(fmt.completion_delta(d.index, echoed, scored, None))
    lp = tally.logprobs(d.index, d.logprobs, d.text)
    if chat:
        event = tally.texts[d.index].event(d.index, d.text, lp, d.finish_reason)
        events += [event] if event is not None else []
    else:
        events.append(fmt.completion_delta(d.index, d.text, lp, d.finish_reason))
    done = tally.choices[d.index] if d.finish_reason is not None else None
    extra = tally.vllm.chunk_choice(d.index, d.token_ids, bool(events), done)
    return [*events[:-1], events[-1] | extra] if events else events
