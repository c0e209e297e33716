"""One streaming request to an OpenAI-compatible endpoint, timed chunk by chunk.

Times are `time.perf_counter()` seconds. The first token is the first chunk that carries
text; inter-token latencies are the gaps between text chunks (a server that batches
several tokens per chunk shows one long gap, as in vLLM's and SGLang's benchmarks).
Token counts and cached prompt tokens come from the final `usage` chunk, which is asked
for with `stream_options.include_usage`; without it the chunk count stands in.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.workloads import Turn


@dataclass
class RequestResult:
    """What one request measured. `start` is relative to the run's start; others are spans."""

    request_id: int
    client: int
    round: int
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ok: bool = False
    error: str = ""
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token answer."""
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "client": self.client, "round": self.round,
            "ok": self.ok, "error": self.error, "start_s": round(self.start, 6),
            "ttft_s": round(self.ttft, 6), "e2e_s": round(self.e2e, 6),
            "tpot_s": None if self.tpot is None else round(self.tpot, 6),
            "itl_s": [round(x, 6) for x in self.itl],
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }  # fmt: skip


@dataclass
class Endpoint:
    """Where and how to send: base URL (…/v1), model name, API flavour, extra body fields.
    Several base URLs, comma-separated (routers active-active): client-side round robin,
    request `i` to URL `i mod n` (the turns of a conversation alternate between them)."""

    base_url: str
    model: str
    api: str = "chat"  # chat: /chat/completions with messages; completions: one text prompt
    api_key: str = ""
    ignore_eos: bool = True
    timeout: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api not in ("chat", "completions"):
            raise ValueError(f"--api: expected chat or completions, got {self.api!r}")
        if self.timeout <= 0:
            raise ValueError("--request-timeout: must be > 0")
        self.bases = [u.strip().rstrip("/") for u in self.base_url.split(",") if u.strip()]
        if not self.bases:
            raise ValueError("--base-url: empty")
        self.base_url = self.bases[0]

    def url(self, request_id: int = 0) -> str:
        base = self.bases[request_id % len(self.bases)]
        return f"{base}/{'chat/completions' if self.api == 'chat' else 'completions'}"

    def body(self, turn: Turn) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": turn.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        if self.ignore_eos:
            # So every request produces exactly max_tokens (vLLM, SGLang and Tandem take it;
            # OpenAI's own API ignores unknown fields).
            body["ignore_eos"] = True
        if self.api == "chat":
            body["messages"] = turn.messages
        else:
            body["prompt"] = "\n\n".join(m["content"] for m in turn.messages)
        body.update(turn.extra)
        body.update(self.extra)
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def send(http: aiohttp.ClientSession, ep: Endpoint, turn: Turn, t0: float) -> RequestResult:
    """Send `turn`, read its stream to the end; never raises for a failed request."""
    res = RequestResult(turn.request_id, turn.client, turn.round)
    start = time.perf_counter()
    res.start = start - t0
    try:
        async with asyncio.timeout(ep.timeout):
            await _stream(http, ep, turn, res, start)
    except TimeoutError:
        res.error = f"timeout after {ep.timeout}s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - start
    res.ok = not res.error
    if res.ok and not res.completion_tokens:
        res.completion_tokens = len(res.itl) + (1 if res.ttft else 0)
    return res


async def _stream(
    http: aiohttp.ClientSession, ep: Endpoint, turn: Turn, res: RequestResult, start: float
) -> None:
    last = start
    parts: list[str] = []
    async with http.post(ep.url(turn.request_id), json=ep.body(turn), headers=ep.headers()) as resp:
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                res.error = f"stream error: {str(chunk['error'])[:300]}"
                return
            text = _chunk_text(chunk, ep.api)
            if text:
                now = time.perf_counter()
                if not parts:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                parts.append(text)
            usage = chunk.get("usage")
            if usage:
                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                res.completion_tokens = int(usage.get("completion_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                res.cached_tokens = int(details.get("cached_tokens") or 0)
    res.text = "".join(parts)
    if not parts and not res.error:
        res.error = "no tokens in the stream"


def _chunk_text(chunk: dict[str, Any], api: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if api == "chat":
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""
