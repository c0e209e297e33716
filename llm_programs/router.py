"""The HTTP client of a Tandem router (any server with the same API): the only place this
package touches the network.

Three requests, all JSON over HTTP, each bounded by `timeout` (connect included), so no
call waits forever on a router that stopped answering:

    complete(call, body)  POST /v1/completions            -> the response body
    stream(call, body)    POST /v1/completions, stream on -> its SSE events, one dict each
    render(call, messages, generation_prompt)
                          POST /v1/chat/render            -> the chat template's text

`call` labels the request in errors ("qa: gen('answer')"). A non-2xx answer, an `error`
event in a stream, a refused connection or a timeout each raise a CallError naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from llm_programs.errors import CallError, CallTimeout

ERROR_BODY_CHARS = 500  # of a non-JSON error body, quoted in the exception


class Router:
    """Where programs send their calls. Opened by `async with router:` or by
    Program.arun/arun_batch (which close what they opened); `close()` is safe twice."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        api_key: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: must start with http:// or https://, got {base_url!r}")
        if not timeout > 0 or not connect_timeout > 0:
            raise ValueError(
                f"timeout, connect_timeout: must be > 0, got {timeout}, {connect_timeout}"
            )
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model, self.timeout = model, timeout
        self._connect_timeout = connect_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        if self._http is None:
            timeout = aiohttp.ClientTimeout(total=self.timeout, connect=self._connect_timeout)
            self._http = aiohttp.ClientSession(timeout=timeout, headers=self._headers)

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    async def __aenter__(self) -> Router:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Router]:
        """Open for the block unless already open; close only what this opened."""
        if self._http is not None:
            yield self
            return
        async with self:
            yield self

    async def complete(self, call: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._post(call, "/v1/completions", body)

    async def render(
        self, call: str, messages: list[dict[str, str]], generation_prompt: bool
    ) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": generation_prompt,
        }
        out = await self._post(call, "/v1/chat/render", body)
        if not isinstance(out.get("prompt"), str):
            raise CallError(call, "/v1/chat/render answered without a 'prompt' string")
        return out["prompt"]

    async def stream(self, call: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The events of a streamed completion, in order, without the final [DONE]; the
        whole stream is bounded by `timeout`."""
        http = self._require(call)
        try:
            async with asyncio.timeout(self.timeout):
                url = self.base_url + "/v1/completions"
                async with http.post(url, json={**body, "stream": True}) as r:
                    await _raise_for_status(call, r)
                    async for event in _sse(call, r.content):
                        yield event
        except TimeoutError:
            raise CallTimeout(call, f"no complete answer within {self.timeout} s") from None
        except aiohttp.ClientError as e:
            raise CallError(call, f"connection to {self.base_url} failed: {e}") from None

    async def _post(self, call: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        http = self._require(call)
        try:
            async with asyncio.timeout(self.timeout):
                async with http.post(self.base_url + path, json=body) as r:
                    await _raise_for_status(call, r)
                    return orjson.loads(await r.read())
        except TimeoutError:
            raise CallTimeout(call, f"no answer within {self.timeout} s") from None
        except aiohttp.ClientError as e:
            raise CallError(call, f"connection to {self.base_url} failed: {e}") from None
        except orjson.JSONDecodeError:
            raise CallError(call, f"{path} answered with a body that is not JSON") from None

    def _require(self, call: str) -> aiohttp.ClientSession:
        if self._http is None:
            raise CallError(call, "the Router is not open (use `async with router:`)")
        return self._http


async def _raise_for_status(call: str, r: aiohttp.ClientResponse) -> None:
    if r.status < 300:
        return
    text = (await r.read()).decode(errors="replace")
    try:
        error = orjson.loads(text).get("error") or {}
        message = error.get("message") or text[:ERROR_BODY_CHARS]
    except (orjson.JSONDecodeError, AttributeError):
        message = text[:ERROR_BODY_CHARS]
    raise CallError(call, f"the router answered {r.status}: {message}", r.status)


async def _sse(call: str, content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """`data:` lines of an SSE body as dicts, up to `[DONE]`; an `error` event, or a body
    that ends without `[DONE]` (a cut stream, not a whole answer), raises a CallError."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            message = f"the stream sent an event that is not JSON: {data[:80]!r}"
            raise CallError(call, message) from None
        if "error" in event:
            message = (event["error"] or {}).get("message", "error event")
            raise CallError(call, f"the stream ended with an error: {message}")
        yield event
    raise CallError(call, "the stream ended before its [DONE] (the connection closed)")
