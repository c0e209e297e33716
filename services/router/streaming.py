"""Server-Sent Events framing, and merging the streams of several choices into one.

Framing is OpenAI's: each event is `data: <one JSON object>\\n\\n`; the stream ends with
`data: [DONE]\\n\\n`; an error after the stream started is one more event whose object
is `{"error": {...}}`, then `[DONE]`. JSON never holds a raw newline (orjson escapes
them), so one `data:` line per event is always enough.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import orjson
from aiohttp import web

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
_END = object()


def sse(obj: Any) -> bytes:
    """One SSE event carrying `obj` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def parse_sse(raw: bytes) -> list[Any]:
    """Inverse of the framing (for tests and the benchmark): objects, then "[DONE]"."""
    out: list[Any] = []
    for event in raw.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :]
                out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


async def open_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies (nginx) must not hold events back
            **headers,
        },
    )
    await response.prepare(request)
    return response


async def merge(sources: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of all `sources` as they come; the first exception stops everything.

    Leaving early (or an exception) cancels the producers, which close their sources, so
    each source's cleanup (a cancel to the workers) runs before this returns.
    """
    if len(sources) == 1:
        async with contextlib.aclosing(sources[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(source: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(source) as it:
                async for item in it:
                    await queue.put(item)
        except BaseException as e:
            await queue.put(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        else:
            await queue.put(_END)

    tasks = [asyncio.create_task(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                if not isinstance(item, asyncio.CancelledError):
                    raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
