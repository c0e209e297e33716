"""The router's own overhead: the HTTP + NATS path against the same workers called directly.

    python -m bench.router --json          # starts nats-server, one decode worker, a router

Two clients take turns on the same worker, so both see the same model and load:
- `router`: POST /v1/completions, stream, through the router (tokenize, route, SSE), read
  by a lean HTTP client that stamps each event when its bytes arrive (bench/http_stream.py;
  `--client aiohttp` reads with aiohttp instead, its own queueing included);
- `direct`: GenerateRequest straight to the decode worker over NATS, TokenChunks read from
  the stream subject (what the router itself does, minus HTTP, tokenization and routing).
Per concurrency level (1 and 64 by default) it reports p50/p99 of time to first token and
of inter-token gaps for both, and the router's added latency as the difference of the
p50s (per request: TTFT; per token: gap). Prompts are token ids, greedy, ignore_eos, so
both paths generate exactly the same number of tokens; every request has a prompt of its
own (no prefix-cache hits on either path: `cached_tokens` in the output says so).

The difference of p50s taken minutes apart swings by tens of ms on a busy machine, so the
router's requests are also timed against the bus itself, in the same request: a watcher
process (bench/bus_watch.py; CLOCK_MONOTONIC, shared with this client) stamps the
generate subject and the token chunks (matched by the `x-request-id` the router passes on
as the GenerateRequest's label),
and the run reports
- `front`: POST -> GenerateRequest on the bus, against send -> the same for `direct`;
- `worker_ttft`: GenerateRequest on the bus -> first token on the bus (the worker's part);
- `hold`: a TokenChunk on the bus -> its SSE event here (the first token's, and per token);
  for `direct`, a TokenChunk on the bus -> the same chunk read here over NATS (what the
  client itself adds to any hold: its reading of 64 streams in one event loop).
`paired_added_ms_per_request_p50` = front (router - direct) + hold of the first token.
`router_cpu_ms_per_request`: the router process's CPU time over its batches (/proc), per
request (its whole life: request, routing and every token's SSE event).
`floor` (bench/router_floor.py; `--no-floor` skips it), measured after the cluster
stopped: aiohttp alone, with the router's SSE writer and this lean client, at the same
levels: `front` (POST -> handler) and `hold` (a step -> its event here). `verdicts` puts
each level's paired figures next to the goals (issue 7: < 3 ms a request, < 0.5 ms a
token at p50) and says where a goal is under that floor.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import nats
import orjson

from bench import router_floor
from bench.http_stream import LeanClient
from libs.common import event_loop
from libs.common.bus.connection import Bus
from libs.common.log import setup_logging
from libs.common.messages.control import (
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


class Trace:
    """One request's timestamps (time.monotonic: the bus watcher's clock too): start and
    tokens seen here; `seen` (GenerateRequest) and `on_bus` (chunks with tokens) are the
    watcher's, filled in after the batch."""

    def __init__(self, rid: str):
        self.rid, self.start, self.times, self.cached = rid, 0.0, [], 0
        self.seen: float | None = None
        self.on_bus: list[float] = []


class BusWatch:
    """The bus watcher process (bench/bus_watch.py) and what it saw, taken batch by batch."""

    def __init__(self, nats_url: str, env: dict[str, str]):
        args = ["--nats-url", nats_url, "--worker", "bench-d1", "--router", "bench-router"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.bus_watch", *args], env=env, stdout=sys.stderr
        )  # its log lines must not reach this run's stdout (the JSON)

    async def wait_ready(self, bus: Bus) -> None:
        """Until the watcher answers a take (it subscribes to everything before that)."""
        for _ in range(300):
            try:
                await bus.nc.request("tandem.bench.watch.take", b"", timeout=1)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
        raise RuntimeError("bench.bus_watch did not start")

    async def take(self, bus: Bus, traces: list[Trace]) -> None:
        await bus.nc.flush()
        await asyncio.sleep(0.05)  # the watcher's copy of the last chunks may still be on the way
        msg = await bus.nc.request("tandem.bench.watch.take", b"", timeout=30)
        seen = orjson.loads(msg.data)
        for t in traces:
            t.seen = seen["generate"].get(t.rid)
            t.on_bus = seen["chunks"].get(t.rid, [])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _router_body(ids: list[int], n: int) -> dict:
    return {"model": "default", "prompt": ids, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def _event(t: Trace, data: bytes, when: float) -> None:
    """One SSE event's JSON (`data` without `data: `), seen at `when`."""
    if not data.startswith(b"{"):
        return
    if b'"choices":[]' in data:  # the usage event
        t.cached = orjson.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
    elif b'"text":""' not in data:
        t.times.append(when)


async def via_router(client: LeanClient, ids: list[int], n: int):
    """Through the router, read by the lean client (bench/http_stream.py, the default)."""
    t = Trace(uuid.uuid4().hex)
    body = _router_body(ids, n)
    t.start, events = await client.stream("/v1/completions", body, {"x-request-id": t.rid})
    for data, when in events:
        _event(t, data, when)
    return t


async def via_router_aiohttp(http: aiohttp.ClientSession, url: str, ids: list[int], n: int):
    """The same with aiohttp's client (`--client aiohttp`): its own queueing included."""
    t = Trace(uuid.uuid4().hex)
    body = _router_body(ids, n)
    t.start = time.monotonic()
    async with http.post(
        f"{url}/v1/completions", json=body, headers={"x-request-id": t.rid}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: "):
                _event(t, line[6:].rstrip(), time.monotonic())
    return t


async def direct(bus: Bus, worker: str, ids: list[int], n: int):
    t = Trace(uuid.uuid4().hex)
    subject = f"tandem.stream.{t.rid}"
    queue: asyncio.Queue = asyncio.Queue()
    sub = await bus.nc.subscribe(subject, cb=queue.put)
    sampling = SamplingSpec(max_tokens=n, temperature=0.0, ignore_eos=True)
    t.start = time.monotonic()
    try:
        request = GenerateRequest(t.rid, ids, sampling, subject)
        await bus.request(f"tandem.decode.{worker}.generate", request, GenerateAccepted, 30)
        while True:
            chunk = TokenChunk.decode((await asyncio.wait_for(queue.get(), 600)).data)
            if chunk.token_ids:
                t.times.append(time.monotonic())
            if chunk.finish_reason is not None:
                t.cached = sum(chunk.usage.cached_tokens.values()) if chunk.usage else 0
                return t
    finally:
        await sub.unsubscribe()


def prompt(k: int) -> list[int]:
    """The k-th prompt: its first page differs from every other k's below 4000 (13 is
    invertible mod 4000), so no request hits a page that another one computed."""
    return [1, *[(97 + 13 * k + 7 * j) % 4000 + 100 for j in range(40)]]


class Samples:
    """Raw timings of one path at one concurrency, pooled over its batches."""

    def __init__(self):
        self.ttft, self.gaps, self.front, self.hold_first, self.hold = [], [], [], [], []
        self.worker: list[float] = []  # GenerateRequest on the bus -> first token on the bus
        self.cached = 0

    async def batch(self, concurrency: int, run, prompts: itertools.count, watch, bus) -> None:
        """`concurrency` requests at once, each with a prompt of its own."""
        traces = await asyncio.gather(*(run(prompt(next(prompts))) for _ in range(concurrency)))
        await watch.take(bus, traces)
        for t in traces:
            self.cached += t.cached
            if t.times:
                self.ttft.append(t.times[0] - t.start)
                self.gaps.extend(b - a for a, b in itertools.pairwise(t.times))
            first = (t.on_bus or t.times or [None])[0]  # the first token, as the bus saw it
            if t.seen is not None and first is not None:
                self.front.append(t.seen - t.start)
                self.worker.append(first - t.seen)
            if t.on_bus and len(t.on_bus) == len(t.times):
                self.hold_first.append(t.times[0] - t.on_bus[0])
                self.hold.extend(a - b for a, b in zip(t.times, t.on_bus, strict=True))

    def summary(self) -> dict:
        ms = lambda v, q: _pct(v, q) * 1e3  # noqa: E731
        out = {"ttft_p50_ms": ms(self.ttft, 0.5), "ttft_p99_ms": ms(self.ttft, 0.99),
               "itl_p50_ms": ms(self.gaps, 0.5), "itl_p99_ms": ms(self.gaps, 0.99),
               "front_p50_ms": ms(self.front, 0.5), "worker_ttft_p50_ms": ms(self.worker, 0.5),
               "requests": len(self.ttft),
               "gaps": len(self.gaps), "cached_tokens": self.cached}  # fmt: skip
        if self.hold:
            out |= {"hold_first_p50_ms": ms(self.hold_first, 0.5),
                    "hold_p50_ms": ms(self.hold, 0.5),
                    "hold_p99_ms": ms(self.hold, 0.99)}  # fmt: skip
        return out


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
        watch = BusWatch(server.url, env)
        try:
            cluster.start(("decode", "router"))
            await cluster.wait_ready(timeout=300)
            await bus.connect()
            await watch.wait_ready(bus)
            router_pid = cluster.procs["router"].pid
            info = await bus.request("tandem.router.bench-router.info", InfoRequest(), ServiceInfo)
            url = f"http://127.0.0.1:{info.details['port']}"
            out: dict = {"max_tokens": args.max_tokens, "prompt_tokens": 41, "levels": {},
                         "client": args.client}  # fmt: skip
            conn = aiohttp.TCPConnector(limit=0)
            # No client timeout: on a loaded 2-core box 64 streams take minutes.
            no_limit = aiohttp.ClientTimeout(total=None, sock_read=None)
            async with aiohttp.ClientSession(connector=conn, timeout=no_limit) as http:
                await _wait_health(http, url)
                n, prompts = args.max_tokens, itertools.count()
                lean = LeanClient("127.0.0.1", info.details["port"])
                if args.client == "aiohttp":
                    router_path = lambda ids: via_router_aiohttp(http, url, ids, n)  # noqa: E731
                else:
                    router_path = lambda ids: via_router(lean, ids, n)  # noqa: E731
                paths = {
                    "router": router_path,
                    "direct": lambda ids: direct(bus, "bench-d1", ids, n),
                }
                for path in paths.values():  # warm-up: first-call costs on both paths
                    await Samples().batch(1, path, prompts, watch, bus)
                for c in args.concurrency:
                    samples = {name: Samples() for name in paths}
                    cpu = [0.0, 0.0]  # the router's user and system CPU s in its own batches
                    # Batch by batch in turn, so a burst of load elsewhere hits both alike.
                    for _ in range(args.repeats * args.rounds):
                        for name, path in paths.items():
                            before = _cpu_seconds(router_pid)
                            await samples[name].batch(c, path, prompts, watch, bus)
                            if name == "router":
                                after = _cpu_seconds(router_pid)
                                spent = zip(cpu, after, before, strict=True)
                                cpu = [c + a - b for c, a, b in spent]
                    merged = {name: s.summary() for name, s in samples.items()}
                    done = merged["router"]["requests"]
                    per = [c * 1e3 / max(done, 1) for c in cpu]
                    merged["router"]["router_cpu_ms_per_request"] = sum(per)
                    merged["router"]["router_cpu_user_sys_ms_per_request"] = per
                    r, d = merged["router"], merged["direct"]
                    merged["added_ms_per_request_p50"] = r["ttft_p50_ms"] - d["ttft_p50_ms"]
                    merged["added_ms_per_token_p50"] = r["itl_p50_ms"] - d["itl_p50_ms"]
                    merged["paired_added_ms_per_request_p50"] = (
                        r["front_p50_ms"] - d["front_p50_ms"] + r["hold_first_p50_ms"]
                    )
                    merged["paired_added_ms_per_token_p50"] = r["hold_p50_ms"]
                    out["levels"][str(c)] = merged  # fmt: skip
                    # Each level as it completes, on stderr: a long run keeps what it has.
                    print(orjson.dumps({str(c): merged}).decode(), file=sys.stderr, flush=True)
            lean.close()
            out["loadavg"] = os.getloadavg()
            return out
        finally:
            await bus.close()
            watch.stop()
            cluster.stop()
            server.stop()


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU time of a process (Linux /proc): the router's own work, whatever
    the waits around it (its share of a step's burst of 64 chunks is this, spread out).
    System time is mostly its sends: on loopback the kernel's TCP path to the reader runs
    in the sender's syscall."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


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
    p.add_argument("--repeats", type=int, default=2, help="multiplies --rounds")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=0, help="router port (0: a free one)")
    p.add_argument(
        "--client",
        choices=("lean", "aiohttp"),
        default="lean",
        help="HTTP client of the router path (bench/http_stream.py, or aiohttp's)",
    )
    p.add_argument("--no-floor", action="store_true",
                   help="skip the aiohttp-only floor (bench/router_floor.py)")  # fmt: skip
    args = p.parse_args()
    setup_logging("warning", "console")  # logs to stderr: stdout is the result
    result = event_loop.run(run(args))
    if not args.no_floor:  # after the cluster stopped: nothing else runs
        floor = router_floor.measure(args.concurrency, args.rounds, args.max_tokens)
        result["floor"] = event_loop.run(floor)
    result["verdicts"] = router_floor.verdicts(result)
    if args.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return
    print("| streams | path | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | front p50 | "
          "hold p50 (first) | added/request | added/token | paired added/request | "
          "paired added/token |\n|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for c, m in result["levels"].items():
        for path in ("direct", "router"):
            r = m[path]
            row = [c, path, f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}",
                   f"{r['itl_p50_ms']:.2f}", f"{r['itl_p99_ms']:.2f}",
                   f"{r['front_p50_ms']:.2f}"]  # fmt: skip
            if path == "router":
                row.append(f"{r['hold_p50_ms']:.2f} ({r['hold_first_p50_ms']:.2f})")
                row += [f"{m[k]:.2f} ms" for k in ("added_ms_per_request_p50",
                        "added_ms_per_token_p50", "paired_added_ms_per_request_p50",
                        "paired_added_ms_per_token_p50")]  # fmt: skip
            else:
                row += [""] * 5
            print("| " + " | ".join(str(x) for x in row) + " |")
    cached = {p: sum(m[p]["cached_tokens"] for m in result["levels"].values()) for p in
              ("router", "direct")}  # fmt: skip
    for c, f in result.get("floor", {}).items():
        print(f"floor, {c} streams (aiohttp alone, bench/router_floor.py): front p50 "
              f"{f['front_p50_ms']:.2f} ms, hold p50 {f['hold_p50_ms']:.2f} ms")  # fmt: skip
    print("\n".join(result["verdicts"]))
    print(f"cached prompt tokens (should be 0): {cached}", file=sys.stderr)
    print(f"load average: {result['loadavg']}", file=sys.stderr)


if __name__ == "__main__":
    main()
