"""bench.frontdoor's load: streamed greedy chats, closed-loop clients at multiples of the
stack's capacity (overload), and a light client beside a flood of another (fairness)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import aiohttp
import orjson

STREAM_PROMPT = "Write a short story about a lighthouse keeper."


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def stream_chat(http: aiohttp.ClientSession, base: str, model: str, headers: dict,
                      max_tokens: int, prompt: str = STREAM_PROMPT) -> dict[str, Any]:  # fmt: skip
    """One streamed greedy chat: its text, finish reason, TTFT, status (a 429 ends it)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    t0 = time.monotonic()
    out: dict[str, Any] = {"status": 0, "text": "", "finish": None, "ttft": None}
    try:
        async with http.post(base + "/chat/completions", json=body, headers=headers) as r:
            out["status"] = r.status
            if r.status != 200:
                out["retry_after"] = float(r.headers.get("Retry-After", "1") or 1)
                await r.read()
                out["seconds"] = time.monotonic() - t0
                return out
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                for choice in orjson.loads(line[6:]).get("choices", []):
                    delta = choice.get("delta", {}).get("content") or ""
                    if delta and out["ttft"] is None:
                        out["ttft"] = time.monotonic() - t0
                    out["text"] += delta
                    out["finish"] = choice.get("finish_reason") or out["finish"]
    except (aiohttp.ClientError, TimeoutError) as e:
        out["error"] = type(e).__name__
    out["seconds"] = time.monotonic() - t0
    return out


class Level:
    """One overload level's tally: TTFTs of the served, latencies of the 429s, failures."""

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.refused: list[float] = []
        self.failed = 0

    async def client(self, http: aiohttp.ClientSession, base: str, model: str, headers: dict,
                     *, max_tokens: int, i: int, end: float) -> None:  # fmt: skip
        n = 0
        while time.monotonic() < end and n < 10_000:
            n += 1
            prompt = f"Client {i} request {n}: {STREAM_PROMPT}"
            r = await stream_chat(http, base, model, headers, max_tokens, prompt)
            if r["status"] == 429:
                self.refused.append(r["seconds"])
                await asyncio.sleep(min(1.0, r.get("retry_after", 1.0)))
            elif r["status"] == 200 and r["ttft"] is not None and "error" not in r:
                self.ttfts.append(r["ttft"])
            else:
                self.failed += 1

    def summary(self, clients: int, wall: float, ttft_slo: float) -> dict[str, Any]:
        good = sum(1 for t in self.ttfts if t <= ttft_slo)
        refused_ms = [s * 1e3 for s in self.refused]
        return {
            "clients": clients,
            "wall_s": round(wall, 1),
            "served": len(self.ttfts),
            "goodput_rps": round(good / wall, 3),
            "ttft_p50_s": round(pct(self.ttfts, 0.5), 3),
            "ttft_p90_s": round(pct(self.ttfts, 0.9), 3),
            "refused_429": len(refused_ms),
            "refused_p99_ms": round(pct(refused_ms, 0.99), 1) if refused_ms else None,
            "refused_max_ms": round(max(refused_ms), 1) if refused_ms else None,
            "failed": self.failed,
        }


async def overload(base: str, model: str, headers: dict, capacity: int, *, seconds: float,
                   ttft_slo: float, max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Closed-loop clients at 1x, 2x and 4x `capacity`, `seconds` each."""
    out: dict[str, Any] = {}
    for factor in (1, 2, 4):
        clients, level = capacity * factor, Level()
        timeout = aiohttp.ClientTimeout(total=300)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
            t0 = time.monotonic()
            end = t0 + seconds
            runs = [level.client(http, base, model, headers, max_tokens=max_tokens, i=i, end=end)
                    for i in range(clients)]  # fmt: skip
            await asyncio.gather(*runs)
            wall = time.monotonic() - t0
        out[f"{factor}x"] = level.summary(clients, wall, ttft_slo)
        print(f"overload {factor}x: {out[f'{factor}x']}", file=sys.stderr)
    base_good = out["1x"]["goodput_rps"] or float("nan")
    out["goodput_2x_over_1x"] = round(out["2x"]["goodput_rps"] / base_good, 3)
    out["goodput_4x_over_1x"] = round(out["4x"]["goodput_rps"] / base_good, 3)
    return out


async def fairness(base: str, model: str, light: dict, flood: dict, streams: int,
                   requests: int) -> dict[str, Any]:  # fmt: skip
    """A light client's `requests` streamed requests (one at a time) alone, then beside
    `streams` closed-loop streams of another client (`flood`: its own key, so its own
    tenant where the router has tenants)."""
    timeout = aiohttp.ClientTimeout(total=300)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:

        async def light_run(tag: str) -> list[dict[str, Any]]:
            return [await stream_chat(http, base, model, light, 32, f"{tag} {i}: {STREAM_PROMPT}")
                    for i in range(requests)]  # fmt: skip

        async def flood_client(i: int) -> None:
            for n in range(10_000):
                r = await stream_chat(
                    http, base, model, flood, 64, f"flood {i} {n}: {STREAM_PROMPT}"
                )
                if r["status"] != 200:
                    await asyncio.sleep(min(1.0, r.get("retry_after", 1.0)))

        alone = await light_run("alone")
        tasks = [asyncio.ensure_future(flood_client(i)) for i in range(streams)]
        try:
            await asyncio.sleep(3.0)  # the flood fills the router's slots and queues first
            beside = await light_run("beside")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
        ok = [r for r in runs if r["status"] == 200 and r["ttft"] is not None]
        return {"ok": len(ok), "of": len(runs),
                "e2e_median_s": round(pct([r["seconds"] for r in ok], 0.5), 3),
                "ttft_median_s": round(pct([r["ttft"] for r in ok], 0.5), 3)}  # fmt: skip

    a, b = stats(alone), stats(beside)
    return {"flood_streams": streams, "alone": a, "beside": b,
            "e2e_ratio": round(b["e2e_median_s"] / a["e2e_median_s"], 2),
            "ttft_ratio": round(b["ttft_median_s"] / a["ttft_median_s"], 2)}  # fmt: skip
