"""From a validated ApiRequest to token ids, and from a worker stream to choice deltas.

`prepare()` tokenizes (chat template for chat), checks the context length and turns the
API's sampling fields into the wire's `SamplingSpec`, refusing what the engine would
refuse with a 400. `run_choice()` runs one choice through the dispatcher and hands each
`Delta` to a callback, observing the latency metrics on the way (`ChoiceDeltas`, called
inside the bus's callback for the chunk, services/router/dispatch.py: it never awaits);
`run_all()` runs the choices of one request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.messages.control import SamplingSpec, TokenChunk
from services.router.dispatch import Dispatcher
from services.router.errors import bad_request
from services.router.metrics import RouterMetrics
from services.router.routing import RouteSelector
from services.router.validation import ApiRequest


@dataclass
class Prompt:
    """One prompt of a request: its ids, its text (for echo) and its sampling."""

    token_ids: list[int]
    text: str
    sampling: SamplingSpec


@dataclass
class Delta:
    """New output of one choice. The last one has `finish_reason` and the usage fields."""

    index: int
    prompt: int  # which prompt of the request this choice belongs to
    text: str
    token_ids: list[int]
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)


Choices = list[Callable[[Callable[[Delta], None]], Coroutine[Any, Any, None]]]
"""One runner per choice of a request: `runner(on_delta)` is the coroutine that generates it."""


def prepare(api: ApiRequest, tokenizer: TextTokenizer, max_model_len: int) -> list[Prompt]:
    if api.endpoint == "chat":
        try:
            text = tokenizer.apply_chat_template(api.messages)
        except Exception as e:  # a template may raise anything; the client sees why
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        sources: list[str | list[int]] = [text]
    else:
        sources = api.prompts
    prompts = []
    for source in sources:
        if isinstance(source, str):
            ids, text = tokenizer.encode(source), source
        else:
            if max(source) >= tokenizer.vocab_size:
                raise bad_request(f"token id {max(source)} is outside the vocabulary", "prompt")
            ids, text = source, tokenizer.decode(source) if api.echo else ""
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        prompts.append(Prompt(ids, text, _sampling(api, len(ids), max_model_len)))
    return prompts


def _sampling(api: ApiRequest, prompt_len: int, max_model_len: int) -> SamplingSpec:
    param = "messages" if api.endpoint == "chat" else "prompt"
    if api.max_tokens is None:
        if prompt_len >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt "
                f"has {prompt_len} tokens, which leaves no room for a completion.",
                param,
            )
        max_tokens = max_model_len - prompt_len
    else:
        max_tokens = api.max_tokens
        if prompt_len + max_tokens > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Shorten the prompt or max_tokens.",
                param,
            )
    values = {**api.sampling, "max_tokens": max_tokens, "logprobs": api.logprobs}
    try:
        params = SamplingParams.from_dict(values)  # the engine's own checks, as a 400
    except ValueError as e:
        raise bad_request(str(e)) from None
    wire = params.to_dict()
    return SamplingSpec(**wire)


class ChoiceDeltas:
    """TokenChunks of one choice -> Deltas for `on_delta`, with the TTFT and ITL metrics."""

    def __init__(
        self, metrics: RouterMetrics, index: int, prompt_index: int, arrived: float,
        on_delta: Callable[[Delta], None],
    ):  # fmt: skip
        self.index, self.prompt_index, self.arrived = index, prompt_index, arrived
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
        delta = Delta(self.index, self.prompt_index, chunk.text, chunk.token_ids, chunk.logprobs)
        if chunk.finish_reason is not None:
            delta.finish_reason = chunk.finish_reason
            usage = chunk.usage
            delta.completion_tokens = usage.completion_tokens if usage else self.produced
            delta.cached = dict(usage.cached_tokens) if usage else {}
        self.on_delta(delta)


async def run_choice(
    dispatcher: Dispatcher,
    selector: RouteSelector,
    metrics: RouterMetrics,
    request_id: str,
    index: int,
    prompt_index: int,
    prompt: Prompt,
    arrived: float,
    timeout: float,
    on_delta: Callable[[Delta], None],
) -> None:
    """One choice: route, dispatch, and hand its Deltas to `on_delta` until it finishes.
    Raises ApiError when it fails, or what `on_delta` raised (the stream stops there)."""
    route = selector.plan(prompt.token_ids)
    deltas = ChoiceDeltas(metrics, index, prompt_index, arrived, on_delta)
    await dispatcher.run(
        request_id, prompt.token_ids, prompt.sampling, route, timeout, deltas.on_chunk
    )


async def run_all(choices: Choices, on_delta: Callable[[Delta], None]) -> None:
    """Every choice to its end; the first failure cancels the others and is raised."""
    if len(choices) == 1:  # the usual request: no task of its own
        await choices[0](on_delta)
        return
    tasks = [asyncio.ensure_future(run(on_delta)) for run in choices]
    try:
        for next_done in asyncio.as_completed(tasks):
            await next_done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
