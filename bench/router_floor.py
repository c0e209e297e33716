"""The HTTP floor of bench.router: what aiohttp alone costs on this host, same client.

The router's added latency has parts no router code can remove: aiohttp accepting and
parsing each POST, and one socket write per stream per token (each a loopback TCP send
that wakes the reader). This measures them with nothing else in the way: a process
serving POST /v1/completions on aiohttp (the same loop choice and the router's own SSE
writer, services/router/formats/sse.py), which answers every request at once with an
event stamped with the handler's entry time, then writes one completion event to every
open stream per "step" (one loop over the streams, as the router does with a decode
step's chunks), each stamped with the step's time; the bench's lean client
(bench/http_stream.py) reads them exactly as it reads the router.

    front  POST sent -> handler entered            (the router's `front` has this in it)
    hold   step time -> that event here            (the router's per-token `hold` too)

No model runs meanwhile, so these are lower bounds of what any aiohttp-based router
gets here. CLOCK_MONOTONIC is shared by the processes (Linux). `verdicts` sets
bench.router's paired figures against the goals and this floor.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from bench.http_stream import LeanClient
from libs.common import event_loop
from services.router.formats.openai import shapes as fmt
from services.router.formats.sse import DONE, SseStream, sse

STEP_S = 0.05  # between steps: long enough for 64 streams' events to drain


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _serve(conn: Any, max_tokens: int) -> None:
    """The floor server (a child process): sends its port, serves until killed."""
    streams: dict[str, tuple[SseStream, asyncio.Future, list[int]]] = {}

    async def completions(request: web.Request) -> web.StreamResponse:
        entered = time.monotonic()
        body = orjson.loads(await request.read())
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        out = SseStream(request, {"x-request-id": rid})
        out.send(sse({"entered": entered, "model": body.get("model")}))
        done = asyncio.get_running_loop().create_future()
        streams[rid] = (out, done, [0])
        try:
            await done
        finally:
            streams.pop(rid, None)
        return await out.finish(DONE)

    async def steps() -> None:
        created = int(time.time())
        while True:
            await asyncio.sleep(STEP_S)
            now = time.monotonic()
            for rid, (out, done, sent) in list(streams.items()):
                if done.done():
                    continue
                choice = fmt.completion_delta(0, " hello", None, None)
                event = fmt.completion_chunk(f"cmpl-{rid}", created, "floor", [choice], None)
                event["t"] = now
                try:
                    out.send(sse(event))
                except ConnectionError as e:
                    done.set_exception(e)
                    continue
                sent[0] += 1
                if sent[0] >= max_tokens:
                    done.set_result(None)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stepper = asyncio.get_running_loop().create_task(steps())
        conn.send(runner.addresses[0][1])
        await asyncio.to_thread(conn.recv)  # until the parent says stop
        stepper.cancel()
        await runner.cleanup()

    event_loop.run(main())


async def _level(client: LeanClient, streams: int, rounds: int, max_tokens: int) -> dict:
    fronts: list[float] = []
    holds: list[float] = []

    async def one() -> None:
        body = {"model": "floor", "prompt": list(range(41)), "max_tokens": max_tokens,
                "stream": True}  # fmt: skip
        headers = {"x-request-id": uuid.uuid4().hex}
        start, events = await client.stream("/v1/completions", body, headers)
        for data, when in events:
            if data == b"[DONE]":
                continue
            obj = orjson.loads(data)
            if "entered" in obj:
                fronts.append(obj["entered"] - start)
            else:
                holds.append(when - obj["t"])

    for _ in range(rounds):
        await asyncio.gather(*(one() for _ in range(streams)))
    ms = lambda v, q: round(_pct(v, q) * 1e3, 3)  # noqa: E731
    return {"requests": len(fronts), "events": len(holds),
            "front_p50_ms": ms(fronts, 0.5), "front_p99_ms": ms(fronts, 0.99),
            "hold_p50_ms": ms(holds, 0.5), "hold_p99_ms": ms(holds, 0.99)}  # fmt: skip


async def measure(levels: list[int], rounds: int, max_tokens: int) -> dict[str, dict]:
    """{streams: front/hold p50/p99} of the floor server, read by the lean client."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, max_tokens), daemon=True)
    proc.start()
    try:
        if not await asyncio.to_thread(parent.poll, 60):
            raise RuntimeError("router floor server did not start within 60 s")
        client = LeanClient("127.0.0.1", parent.recv())
        try:
            await _level(client, 1, 1, max_tokens)  # warm-up
            return {str(c): await _level(client, c, rounds, max_tokens) for c in levels}
        finally:
            client.close()
    finally:
        parent.send("stop")
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()


GOAL_MS = {"request": 3.0, "token": 0.5}  # issue 7: added latency at p50


def verdicts(result: dict) -> list[str]:
    """Each level's paired figures against the goals, and against the floor's: where
    aiohttp alone (front for a request, hold for a token) is over the goal, no router on
    this host gets under it."""
    out = []
    for c, m in result["levels"].items():
        floor = result.get("floor", {}).get(c)
        for unit, key, part in (("request", "paired_added_ms_per_request_p50", "front"),
                                ("token", "paired_added_ms_per_token_p50", "hold")):  # fmt: skip
            goal, got = GOAL_MS[unit], m[key]
            line = f"{c} streams, per {unit}: {got:.2f} ms (goal < {goal}): "
            line += "met" if got < goal else "not met"
            if floor is not None:
                bound = floor[f"{part}_p50_ms"]
                line += f"; aiohttp floor ({part} p50) {bound:.2f} ms"
                if bound >= goal:
                    line += ": the goal is under the floor on this host"
            out.append(line)
    return out
