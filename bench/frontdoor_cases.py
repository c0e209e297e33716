"""The hostile inputs of bench.frontdoor, each one request (or one volley) built before it
is sent, so building it never delays what the bench measures.

Each case is what one client can send through the front door: a grammar padded or split
to hurt the grammar library, thousands of tools, a prompt of millions of ids, logprobs
for everything, renders of huge conversations, a broken Authorization header, and a
thousand sockets that never finish their request. `Case.send` returns what the router
answered: the status of each request (a list: a volley has several) and its latency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass
class Sent:
    """What the router answered one case: statuses (one per request) and seconds each."""

    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    note: str = ""


@dataclass
class Case:
    name: str
    what: str
    send: Callable[[aiohttp.ClientSession, str, dict[str, str]], Awaitable[Sent]]


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict) -> Sent:
    t0 = time.monotonic()
    hdrs = {**headers, "Content-Type": "application/json"}
    try:
        async with http.post(url, data=body, headers=hdrs) as r:
            await r.read()
            return Sent([r.status], [time.monotonic() - t0])
    except (aiohttp.ClientError, TimeoutError) as e:  # a closed connection is an answer too
        return Sent([0], [time.monotonic() - t0], note=type(e).__name__)


def _one(path: str, body: dict) -> Callable[..., Awaitable[Sent]]:
    data = orjson.dumps(body)

    async def send(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> Sent:
        return await _post(http, base + path, data, headers)

    return send


def _volley(path: str, body: dict, count: int) -> Callable[..., Awaitable[Sent]]:
    data = orjson.dumps(body)

    async def send(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> Sent:
        posts = [_post(http, base + path, data, headers) for _ in range(count)]
        done = await asyncio.gather(*posts)
        out = Sent()
        for s in done:
            out.statuses += s.statuses
            out.seconds += s.seconds
        return out

    return send


def _chat(model: str, **fields: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Say yes or no."}],
            "max_tokens": 4, **fields}  # fmt: skip


def _tools(count: int) -> list[dict]:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}}
            for i in range(count)]  # fmt: skip


def _many_rules(size: int) -> str:
    rules, i = ["root ::= r0"], 0
    while sum(len(r) + 1 for r in rules) < size:
        rules.append(f'r{i} ::= "a{i}" | r{i + 1}')
        i += 1
    rules.append(f'r{i} ::= "end"')
    return "\n".join(rules)


async def _bad_auth(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> Sent:
    """Authorization headers no client library sends: raw bytes on a raw socket."""
    host, port = base.removeprefix("http://").split("/")[0].split(":")
    variants = [b"Bearer \xff\xfe\xfa", b"Bearer sk-\xc3(", b"\xe2\x82", b"Bearer ",
                b"Basic Zm9vOmJhcg==", b"Bearer " + b"k" * 7000]  # fmt: skip
    out = Sent()
    for auth in variants:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Authorization: " + auth + b"\r\n\r\n")  # fmt: skip
            line = await asyncio.wait_for(reader.readline(), 10)
            parts = line.split()
            out.statuses.append(int(parts[1]) if len(parts) > 1 else 0)
        except (TimeoutError, ConnectionError, ValueError):
            out.statuses.append(0)
        finally:
            writer.close()
        out.seconds.append(time.monotonic() - t0)
    return out


def cases(model: str) -> list[Case]:
    """Every hostile input, in the order the bench sends them."""
    newline_16k = 'root ::= "yes" | "no"' + "\n" * (16 << 10)
    newline_64k = 'root ::= "yes" | "no"' + "\n" * (64 << 10)
    huge_ids = {"model": model, "prompt": [1] * 8_000_000, "max_tokens": 1}
    logprobs = _chat(model, n=8, max_tokens=256, logprobs=True, top_logprobs=20,
                     temperature=1.0, ignore_eos=True)  # fmt: skip
    render = {"model": model,
              "messages": [{"role": "user" if i % 2 == 0 else "assistant",
                            "content": f"message {i} " * 8} for i in range(2000)]}  # fmt: skip
    return [
        Case("ebnf_newlines_16k", "ebnf grammar padded with 16 KiB of newlines",
             _one("/chat/completions", _chat(model, ebnf=newline_16k))),
        Case("ebnf_newlines_64k", "ebnf grammar padded with 64 KiB of newlines",
             _one("/chat/completions", _chat(model, ebnf=newline_64k))),
        Case("ebnf_rules_32k", "32 KiB of short chained ebnf rules",
             _one("/chat/completions", _chat(model, ebnf=_many_rules(32 << 10)))),
        Case("tools_8000", "8,000 tools",
             _one("/chat/completions", _chat(model, tools=_tools(8000)))),
        Case("prompt_ids_8m", "a completion prompt of 8M token ids",
             _one("/completions", huge_ids)),
        Case("logprobs_n8", "n=8, 256 tokens, top_logprobs 20, not streamed",
             _one("/chat/completions", logprobs)),
        Case("render_64x2000", "64 concurrent /v1/chat/render of 2,000 messages",
             _volley("/chat/render", render, 64)),
        Case("bad_authorization", "malformed Authorization headers (non-UTF-8, empty, huge)",
             _bad_auth),
    ]  # fmt: skip


async def hold_slow_sockets(host: str, port: int, count: int, hold_s: float, auth: str) -> dict:
    """`count` sockets that never finish a request (a third idle, a third dripping header
    bytes, a third a 10 MB body stalled after 1 KiB), held `hold_s` seconds: how many
    opened, and how many the router closed meanwhile (and after how long). On loopback they
    come from four addresses, as from four clients."""
    opened, closed_after = 0, []
    kinds = ("idle", "dripping headers", "stalled body")
    open_by_kind = dict.fromkeys(kinds, 0)
    t0 = time.monotonic()

    async def one(i: int) -> None:
        nonlocal opened
        try:
            # Spread over 127.0.0.2-5 on loopback: four clients, each under a per-address cap.
            local = (f"127.0.0.{2 + i % 4}", 0) if host == "127.0.0.1" else None
            opening = asyncio.open_connection(host, port, local_addr=local)
            reader, writer = await asyncio.wait_for(opening, 5)
        except (OSError, TimeoutError):
            return
        opened += 1
        kind = i % 3
        open_by_kind[kinds[kind]] += 1
        try:
            if kind == 1:
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            if kind == 2:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: " + auth.encode() + b"\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
                             + b" " * 1024)  # fmt: skip
            end = t0 + hold_s
            while time.monotonic() < end:
                if kind == 1:
                    writer.write(b"a")  # one header byte a second
                try:
                    data = await asyncio.wait_for(reader.read(4096), 1.0)
                except TimeoutError:
                    continue
                if not data:  # the router closed it
                    closed_after.append(time.monotonic() - t0)
                    open_by_kind[kinds[kind]] -= 1
                    return
                while await reader.read(4096):  # an error answer: read to the close
                    pass
                closed_after.append(time.monotonic() - t0)
                open_by_kind[kinds[kind]] -= 1
                return
        except (ConnectionError, OSError):
            closed_after.append(time.monotonic() - t0)
            open_by_kind[kinds[kind]] -= 1
        finally:
            writer.close()

    await asyncio.gather(*[one(i) for i in range(count)])
    closed_after.sort()
    return {
        "sockets": count,
        "opened": opened,
        "closed_by_router": len(closed_after),
        "still_open_by_kind": open_by_kind,
        "held_s": hold_s,
        "first_closed_s": round(closed_after[0], 2) if closed_after else None,
        "last_closed_s": round(closed_after[-1], 2) if closed_after else None,
    }
