"""What a client sees: completions through the router's HTTP API, whole or streamed.

Nothing here raises for an HTTP status or a broken connection: every request ends as an
`Outcome` the test asserts on, within its own time bound.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass
class Outcome:
    """One completion as the client saw it: HTTP status, text, and the error if any."""

    status: int
    text: str = ""
    error: str = ""
    usage: dict = field(default_factory=dict)
    seconds: float = 0.0
    events: int = 0  # SSE data events (streams)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def body(ids: list[int], max_tokens: int, ignore_eos: bool, stream: bool = False) -> dict:
    return {"model": "default", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": stream}  # fmt: skip


async def complete(
    http: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int, ignore_eos: bool,
    timeout: float = 90.0,
) -> Outcome:  # fmt: skip
    """A non-streaming completion; never raises for HTTP or connection errors."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            async with http.post(f"{url}/v1/completions",
                                 json=body(ids, max_tokens, ignore_eos)) as r:  # fmt: skip
                data = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as e:
        return Outcome(0, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
    took = time.monotonic() - start
    if r.status != 200:
        return Outcome(r.status, error=str(data.get("error", data)), seconds=took)
    return Outcome(200, data["choices"][0]["text"], usage=data.get("usage", {}), seconds=took)


class Stream:
    """A streaming completion read in the background: `text` grows, `outcome` at the end."""

    def __init__(self, http: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int,
                 ignore_eos: bool, timeout: float = 120.0):  # fmt: skip
        self.text, self.tokens, self.ended_at = "", 0, 0.0
        self.outcome: Outcome | None = None
        self.task = asyncio.create_task(
            self._run(http, url, body(ids, max_tokens, ignore_eos, stream=True), timeout)
        )

    async def _run(self, http, url: str, req: dict, timeout: float) -> Outcome:
        start, error, status, events = time.monotonic(), "", 0, 0
        try:
            async with asyncio.timeout(timeout):
                async with http.post(f"{url}/v1/completions", json=req) as r:
                    status = r.status
                    if status != 200:
                        error = (await r.text())[:500]
                    else:
                        async for raw in r.content:
                            line = raw.decode().strip()
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            events += 1
                            event = orjson.loads(line[6:])
                            if "error" in event:
                                error = event["error"].get("message", str(event["error"]))
                                continue
                            for choice in event.get("choices", []):
                                self.text += choice.get("text", "")
                                self.tokens += 1
        except (aiohttp.ClientError, TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
        self.ended_at = time.monotonic()
        self.outcome = Outcome(status, self.text, error, seconds=self.ended_at - start,
                               events=events)  # fmt: skip
        return self.outcome

    async def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while self.tokens < n:
                if self.task.done():
                    raise AssertionError(f"stream ended early: {self.task.result()}")
                await asyncio.sleep(0.05)
