"""A request at the gate, in any API format: its tenant, its cost in tokens before it is
tokenized, its deadline header, and its cache salt rooted in its tenant.

Used by lifecycle.run_request (generations) and by the cheap endpoints (tokenize, render,
count_tokens, pins) through `light`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from services.router.admission.gate import GATE, Ticket
from services.router.admission.tenants import DEFAULT, Tenant, cache_salt
from services.router.errors import bad_request
from services.router.formats.openai.validation import ApiRequest

DEADLINE_HEADER = "x-request-deadline-ms"
MAX_DEADLINE_MS = 3_600_000
CHARS_PER_TOKEN = 4  # the estimate of a text's tokens before it is tokenized
WALK_BYTES = 64 << 10  # bodies up to this size are walked for the estimate; larger: sized
UNSET_MAX_TOKENS = 1024  # the completion a request without max_tokens is counted for
TENANT = "tenant"  # request[TENANT]: set by the app's middleware (api/app.py)


def tenant(request: web.Request) -> Tenant:
    return request.get(TENANT, DEFAULT)


async def admit(request: web.Request, api: ApiRequest, context_len: int) -> Ticket:
    """Admit a parsed request (it may wait in its tenant's queue), or raise ApiError. Its
    cache salt is rooted in its tenant from here on (api.sampling['cache_salt'])."""
    who = tenant(request)
    salt = cache_salt(who, api.sampling.get("cache_salt", ""))
    if salt:
        api.sampling["cache_salt"] = salt
    prompts = max(1, len(api.prompts))
    prompt_tokens = await _estimate(request, api.prompts or api.messages)
    unset = min(UNSET_MAX_TOKENS, context_len - prompt_tokens)
    completion = max(1, api.max_tokens if api.max_tokens is not None else unset)
    cost = prompts * (prompt_tokens + api.n * completion)
    deadline = deadline_of(request)
    gate = request.app[GATE]
    return await gate.enter(who, cost, prompts * api.n, api.priority, deadline,
                            prompt_cost=prompts * prompt_tokens)  # fmt: skip


@contextlib.asynccontextmanager
async def light(request: web.Request, body: Any) -> AsyncIterator[None]:
    """A request that runs no generation, through its tenant's rate and concurrency
    checks (body: what it will tokenize or render, for its cost)."""
    async with request.app[GATE].light(tenant(request), await _estimate(request, body)):
        yield


def deadline_of(request: web.Request) -> float | None:
    """The latest start (on time.monotonic) the deadline header allows, or None."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 7) or int(raw) > MAX_DEADLINE_MS:
        raise bad_request(
            f"{DEADLINE_HEADER} must be an integer number of milliseconds in [1, "
            f"{MAX_DEADLINE_MS}]",
            DEADLINE_HEADER,
        )
    arrived = request.get("arrived", time.monotonic())
    return float(arrived) + int(raw) / 1000.0


async def _estimate(request: web.Request, value: Any) -> int:
    """`estimate_tokens(value)` for a body of up to WALK_BYTES; past that, its size in bytes
    / CHARS_PER_TOKEN, so the event loop never walks a large body (a body may hold half a
    million items: a walk of it would hold the loop for a quarter of a second)."""
    size = request.content_length
    if size is None and request.body_exists:
        size = len(await request.read())  # chunked: aiohttp keeps the bytes it read
    if size is not None and size > WALK_BYTES:
        return size // CHARS_PER_TOKEN + 1
    return estimate_tokens(value)


def estimate_tokens(value: Any, depth: int = 0) -> int:
    """Tokens in a prompt, list of prompts or messages before tokenizing: a text's
    characters / CHARS_PER_TOKEN, an id list's length (not walked: it may hold millions).
    Cheap next to the JSON parse that made `value` (one pass over the texts and messages,
    which the budget bounds; nesting bounded)."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_TOKEN + 1
    if isinstance(value, int):
        return 1
    if depth > 4:
        return 0
    if isinstance(value, list | tuple):
        if value and isinstance(value[0], int):  # token ids: counted, not walked
            return len(value)
        return sum(estimate_tokens(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(estimate_tokens(v, depth + 1) for v in value.values())
    return 0
