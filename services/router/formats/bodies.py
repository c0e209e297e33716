"""What every JSON endpoint of the router checks first: a JSON object body, the fields it
may hold, and the model it names (a 400 or a 404 in OpenAI's shape).

Decoding and checking a body is work proportional to its size (16 MiB: seconds of pure
Python in the checks), so `parsed` runs it in a thread past INLINE_BYTES: the event loop
keeps serving every other request meanwhile (the thread lets go of the GIL every switch
interval). A small body is parsed inline, where it costs less than the hop to a thread.

The decoder itself (orjson) holds the GIL for the whole call, thread or not, at ~0.1 us
a number and more a list or object: 8M ids held the loop ~1 s. So `read` counts the
body's commas first (every item of a list or member of an object after the first has
one; `bytes.count`, C speed, a MiB at a time) and refuses a body with more than
--max-body-items before it is decoded; and `decode` pauses the cyclic garbage collector
while it decodes (it would walk the new containers again and again: 1M small lists,
1.5 s instead of 0.27 s).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import orjson
from aiohttp import web

from services.router.errors import ApiError, bad_request
from services.router.state import STATE, RouterState

T = TypeVar("T")
# Bodies up to this many bytes are parsed on the event loop (tens of microseconds).
INLINE_BYTES = 16 << 10
# Bytes of a body whose commas are counted at once (~0.2-1 ms) before the loop runs again.
COUNT_STEP = 1 << 20


async def parsed(request: web.Request, parse: Callable[[Any], T]) -> T:
    """`parse(body)` of the decoded body: inline for a small body, in a thread for a large
    one (its decoding too). Raises what `parse` raises; a 400 when the body is not JSON."""
    raw = await read(request)
    return await off_loop(len(raw), lambda: parse(decode(raw)), request.app[STATE].cpu)


async def read(request: web.Request) -> bytes:
    """The whole body (aiohttp's client_max_size: a 413 past --max-body-bytes; read
    already, within --body-timeout, by api/connections.py); a 400 past --max-body-items
    (commas, those inside strings too), counted a step at a time, the event loop free
    between steps, and refused as soon as the count passes the limit."""
    raw, limit = await request.read(), request.app[STATE].config.max_body_items
    items = 0
    for start in range(0, len(raw), COUNT_STEP):
        items += raw.count(b",", start, start + COUNT_STEP)
        if items > limit:
            raise bad_request(
                f"the body holds more than {limit} JSON items (commas), this server's "
                "limit (--max-body-items); a prompt of token ids is also bounded by "
                "--max-prompt-ids"
            )
        if start:
            await asyncio.sleep(0)
    return raw


async def off_loop(size: int, work: Callable[[], T], pool: Executor | None = None) -> T:
    """`work()`, for input of `size` bytes: inline when small, else on a thread of `pool`
    (RouterState.cpu, --cpu-threads; None: asyncio's default)."""
    if size <= INLINE_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(pool, work)


def decode(raw: bytes) -> Any:
    """The body as decoded JSON (`read`'s: its size bounded); a 400 when it is not JSON."""
    collecting = gc.isenabled()
    gc.disable()  # the decoder holds the GIL: no other thread allocates meanwhile
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    finally:
        if collecting:
            gc.enable()


async def json_body(request: web.Request) -> Any:
    """The body as decoded JSON (in a thread when large); a 400 when it is not JSON."""
    return await parsed(request, lambda body: body)


async def json_object(request: web.Request, fields: tuple[str, ...], path: str) -> dict:
    """A JSON object body with no field outside `fields` (a field we do not read is
    refused, never ignored); a 400 naming the first other one."""
    return closed_object(await json_body(request), fields, path)


def closed_object(body: Any, fields: tuple[str, ...], path: str) -> dict:
    """`body` as a JSON object with no field outside `fields`; a 400 naming the first
    other one."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_request(f"'{unknown[0]}' is not a field of {path}", unknown[0])
    return body


def check_model(state: RouterState, model: Any) -> None:
    """A 404 unless `model` is this router's model name or id."""
    if model not in (state.config.model_name, state.model_id):
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{state.config.model_name}'.",
            param="model",
            code="model_not_found",
        )
