"""The router's own overhead: the HTTP + NATS path against the same workers called directly.

    python -m bench.router --json          # starts nats-server, one decode worker, a router

Two clients take turns on the same worker, so both see the same model and load:
- `router`: POST /v1/completions, stream, through the router (tokenize, route, SSE);
- `direct`: GenerateRequest straight to the decode worker over NATS, TokenChunks read from
  the stream subject (what the router itself does, minus HTTP, tokenization and routing).
Per concurrency level (1 and 64 by default) it reports p50/p99 of time to first token and
of inter-token gaps for both, and the router's added latency as the difference of the
p50s (per request: TTFT; per token: gap). Prompts are token ids, greedy, ignore_eos, so
both paths generate exactly the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import orjson

from libs.common.bus import Bus
from libs.common.log import setup_logging
from libs.common.messages import (
    GenerateAccepted,
    GenerateRequest,
    InfoRequest,
    SamplingSpec,
    ServiceInfo,
    TokenChunk,
)
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def via_router(http: aiohttp.ClientSession, url: str, ids: list[int], n: int):
    body = {"model": "default", "prompt": ids, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start, times = time.perf_counter(), []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"text":""' not in line:
                times.append(time.perf_counter())
    return start, times


async def direct(bus: Bus, worker: str, ids: list[int], n: int):
    rid = uuid.uuid4().hex
    subject = f"tandem.stream.{rid}"
    queue: asyncio.Queue = asyncio.Queue()
    sub = await bus.nc.subscribe(subject, cb=queue.put)
    sampling = SamplingSpec(max_tokens=n, temperature=0.0, ignore_eos=True)
    start, times = time.perf_counter(), []
    try:
        request = GenerateRequest(rid, ids, sampling, subject)
        await bus.request(f"tandem.decode.{worker}.generate", request, GenerateAccepted, 30)
        while True:
            chunk = TokenChunk.decode((await asyncio.wait_for(queue.get(), 600)).data)
            if chunk.token_ids:
                times.append(time.perf_counter())
            if chunk.finish_reason is not None:
                return start, times
    finally:
        await sub.unsubscribe()


async def level(concurrency: int, rounds: int, run) -> dict:
    ttft, gaps = [], []

    async def one(k: int) -> None:
        ids = [1, *[(97 + 13 * k + 7 * j) % 4000 + 100 for j in range(40)]]
        start, times = await run(ids)
        if times:
            ttft.append(times[0] - start)
            gaps.extend(b - a for a, b in itertools.pairwise(times))

    for r in range(rounds):
        await asyncio.gather(*(one(r * concurrency + k) for k in range(concurrency)))
    return {"ttft_p50_ms": _pct(ttft, 0.5) * 1e3, "ttft_p99_ms": _pct(ttft, 0.99) * 1e3,
            "itl_p50_ms": _pct(gaps, 0.5) * 1e3, "itl_p99_ms": _pct(gaps, 0.99) * 1e3,
            "requests": len(ttft), "gaps": len(gaps)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict:
    # SIGTERM (e.g. from `timeout`) cancels the run, so the finally below stops the processes.
    main_task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_LOG_FORMAT"] = "json"
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        cluster = LocalCluster(server.url, env=env, capture=Path(tmp) / "logs", args={
            # One model thread: on 2 cores the router and this client need the other core,
            # or every step's 2-thread OpenMP region stalls on whoever else runs, and the
            # "overhead" measured is the worker's slowdown, not the router's work.
            "decode": ["--service-id", "bench-d1", "--kv-cache-mb", "256", "--no-pool", "true",
                       "--num-threads", "1"],
            "router": ["--service-id", "bench-router", "--port", str(args.port),
                       "--max-pending", "1024"],
        })  # fmt: skip
        bus = Bus(server.url, "bench-router", connect_timeout=10, request_timeout=30)
        try:
            cluster.start(("decode", "router"))
            await cluster.wait_ready(timeout=300)
            await bus.connect()
            info = await bus.request("tandem.router.bench-router.info", InfoRequest(), ServiceInfo)
            url = f"http://127.0.0.1:{info.details['port']}"
            out: dict = {"max_tokens": args.max_tokens, "prompt_tokens": 41, "levels": {}}
            conn = aiohttp.TCPConnector(limit=0)
            # No client timeout: on a loaded 2-core box 64 streams take minutes.
            no_limit = aiohttp.ClientTimeout(total=None, sock_read=None)
            async with aiohttp.ClientSession(connector=conn, timeout=no_limit) as http:
                await _wait_health(http, url)
                n = args.max_tokens
                for c in args.concurrency:
                    rows = {"router": [], "direct": []}
                    for _ in range(args.repeats):  # alternate, so drift hits both alike
                        rows["router"].append(
                            await level(c, args.rounds, lambda ids: via_router(http, url, ids, n))
                        )
                        rows["direct"].append(
                            await level(c, args.rounds, lambda ids: direct(bus, "bench-d1", ids, n))
                        )
                    merged = {k: _median_rows(v) for k, v in rows.items()}
                    merged["added_ms_per_request_p50"] = (
                        merged["router"]["ttft_p50_ms"] - merged["direct"]["ttft_p50_ms"]
                    )
                    merged["added_ms_per_token_p50"] = (
                        merged["router"]["itl_p50_ms"] - merged["direct"]["itl_p50_ms"]
                    )
                    out["levels"][str(c)] = merged  # fmt: skip
                    # Each level as it completes, on stderr: a long run keeps what it has.
                    print(orjson.dumps({str(c): merged}).decode(), file=sys.stderr, flush=True)
            out["loadavg"] = os.getloadavg()
            return out
        finally:
            await bus.close()
            cluster.stop()
            server.stop()


def _median_rows(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


async def _wait_health(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(600):
        try:
            async with http.get(f"{url}/health") as r:
                # Decode alone serves (it prefills itself), though /health wants a pair.
                if (await r.json())["workers"]["decode"] >= 1:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("router not healthy")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--rounds", type=int, default=3, help="batches of requests per level")
    p.add_argument("--repeats", type=int, default=2, help="router/direct alternations")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=0, help="router port (0: a free one)")
    args = p.parse_args()
    setup_logging("warning", "console")  # logs to stderr: stdout is the result
    result = asyncio.run(run(args))
    if args.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return
    print("| streams | path | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | added/request | "
          "added/token |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for c, m in result["levels"].items():
        for path in ("direct", "router"):
            r = m[path]
            added = m["added_ms_per_request_p50"], m["added_ms_per_token_p50"]
            extra = f"{added[0]:.2f} ms | {added[1]:.2f} ms" if path == "router" else " | "
            print(
                f"| {c} | {path} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {extra} |"
            )
    print(f"load average: {result['loadavg']}", file=sys.stderr)


if __name__ == "__main__":
    main()
