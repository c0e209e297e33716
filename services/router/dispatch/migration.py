"""Migration: one choice's generation across its attempts, and where the next one goes.

    gen = Generation(prompt, sampling, sink)   every attempt feeds gen.deliver, in order;
                                               gen.sent is then exactly what the client has
    next_route(route, failed, gen, error)      the next attempt's Route, or an ApiError

Once the client has tokens, a failed attempt is continued rather than ended: the next
GenerateRequest carries `generated = gen.sent`, and its decode worker prefills prompt +
generated itself (the route's prefill worker is dropped), replays them through the grammar
and stop strings and streams from index len(generated) (services/router/dispatch/dispatcher.py sends
it; docs/reliability.md, "Migration"). Pure Python: no bus here.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import msgspec

from libs.common.messages.control import SamplingSpec, TokenChunk
from services.router.errors import ApiError
from services.router.routing.policy import Route

MAX_MIGRATIONS = 3  # continuations of one choice: bounds a request that fails everywhere

Sink = Callable[[TokenChunk], None]


class Generation:
    """One choice's generation across its attempts: the prompt, its sampling, and `sent`,
    the tokens its sink has had (a continuation's `generated`). `deliver` is the sink
    every attempt feeds, in order, so `sent` is exactly what the client holds."""

    def __init__(self, token_ids: list[int], sampling: SamplingSpec, sink: Sink):
        self.token_ids, self.sink = token_ids, sink
        if sampling.temperature > 0 and sampling.seed is None:
            # A continuation must draw from the same random stream as its first attempt.
            sampling = msgspec.structs.replace(sampling, seed=random.getrandbits(63))
        self.sampling = sampling
        self.sent: list[int] = []
        self.migrations = 0  # failures after output, each followed by a continuation
        self.migrating = False  # one just failed: the next route continues it

    def deliver(self, chunk: TokenChunk) -> None:
        self.sink(chunk)
        self.sent += chunk.token_ids


def next_route(
    route: Callable[[set[str]], Route | None],
    failed: set[str],
    gen: Generation,
    error: Exception | None,
) -> Route:
    """The next attempt's route: a live one, avoiding the workers that failed this request
    while others are live (`route` falls back to them). Once the client has output, the
    decode worker prefills the continuation itself; 502 when no decode worker is live or
    the request failed again after `MAX_MIGRATIONS` continuations. Before any output, 503
    when no decode worker is live (nothing was produced: safe to retry)."""
    chosen = route(failed)
    if not gen.sent:
        if chosen is None:
            raise ApiError(503, "no decode worker is live", headers={"Retry-After": "1"})
        return chosen
    if chosen is None or gen.migrations > MAX_MIGRATIONS:
        raise ApiError(502, f"worker failed mid-request: {error}", code="worker_failed")
    return dataclasses.replace(chosen, prefill="")
