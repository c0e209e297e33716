"""Load test: many concurrent streaming clients for a bounded time; prints one JSON report.

    python -m bench.load                       # its own cluster, 256 clients, 120 s
    python -m bench.load --clients 4 --duration 10 --max-tokens 4
    python -m bench.load --url http://127.0.0.1:8000 --pids 123,456

Without --url it starts (and stops, by pid) its own loopback cluster: a nats-server, the
prefill and decode workers on the default model and a router on a free port. Each client
sends streaming /v1/completions of token-id prompts (random lengths, some above the
router's disaggregation threshold, some below) with `ignore_eos`, `logprobs: 0` (one
entry per streamed token) and `include_usage`, one after the other until the time or
the request count is up. A 429 or 503 is honoured: the client waits Retry-After.

No request starts after --duration; those in flight then may finish during --grace
(after it they are cut off and counted, never as errors). The report holds what the
invariants need: requests completed, completed with exact
usage (completion_tokens == tokens streamed == max_tokens, prompt_tokens == prompt
length), 429/503 counts and how many lacked Retry-After, the 5xx count (must be zero),
other errors (with samples), TTFT p50/p99, and per service process the peak RSS
(VmHWM from /proc, sampled until the end) and the RSS at the start and end of the load.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.deployments import free_port, wait_healthy
from libs.common import event_loop
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer

WORKER_ARGS = ["--num-threads", "1", "--transport", "tcp", "--no-pool", "true"]
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # token ids safely inside SmolLM2's 49152


@dataclass
class Tally:
    """What the clients saw, summed over every request."""

    sent: int = 0
    completed: int = 0
    usage_ok: int = 0
    usage_bad: list[str] = field(default_factory=list)
    status: collections.Counter = field(default_factory=collections.Counter)
    no_retry_after: int = 0
    server_errors: list[str] = field(default_factory=list)
    other_errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


class MemorySampler:
    """RSS of named processes, read from /proc/<pid>/status every `interval` seconds."""

    def __init__(self, pids: dict[str, int], interval: float = 0.5):
        self.pids, self.interval = pids, interval
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.peak: dict[str, int] = {}  # max of VmHWM (the kernel's own high-water mark)

    @staticmethod
    def read(pid: int) -> tuple[int, int] | None:
        """(VmRSS, VmHWM) in kB, or None when the process is gone."""
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        try:
            return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
        except (KeyError, ValueError):
            return None

    def sample(self) -> None:
        for name, pid in self.pids.items():
            got = self.read(pid)
            if got is None:
                continue
            rss, hwm = got
            self.first.setdefault(name, rss)
            self.last[name] = rss
            self.peak[name] = max(self.peak.get(name, 0), hwm, rss)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def report(self) -> dict[str, dict[str, float]]:
        mb = 1 / 1024
        return {
            name: {
                "start_rss_mb": round(self.first[name] * mb, 1),
                "end_rss_mb": round(self.last[name] * mb, 1),
                "peak_rss_mb": round(self.peak[name] * mb, 1),
            }
            for name in sorted(self.first)
        }


async def one_request(
    http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
    tally: Tally,
) -> float:  # fmt: skip
    """Send one request and record it; return how long the client should wait first."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "logprobs": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tally.sent += 1
    started = time.monotonic()
    ttft, streamed, usage, error = None, 0, None, None
    try:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            tally.status[r.status] += 1
            if r.status in (429, 503):
                retry = r.headers.get("Retry-After")
                if retry is None:
                    tally.no_retry_after += 1
                    return 1.0
                return max(0.0, float(retry))
            if r.status >= 500:
                tally.server_errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                return 0.0
            if r.status != 200:
                tally.other_errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                return 0.0
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                for choice in event.get("choices") or []:
                    n = len((choice.get("logprobs") or {}).get("tokens") or [])
                    if n and ttft is None:
                        ttft = time.monotonic() - started
                    streamed += n
                if event.get("usage"):
                    usage = event["usage"]
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        tally.other_errors.append(f"{type(e).__name__}: {e}"[:200])
        return 0.0
    if error is not None:
        message = f"stream error: {error.get('message', error)}"[:200]
        is_server = str(error.get("type", "")) in ("internal_error", "upstream_error")
        (tally.server_errors if is_server else tally.other_errors).append(message)
        return 0.0
    tally.completed += 1
    tally.tokens += streamed
    if ttft is not None:
        tally.ttft.append(ttft)
    want = (len(prompt), max_tokens, max_tokens)
    got = (
        (usage or {}).get("prompt_tokens"),
        (usage or {}).get("completion_tokens"),
        streamed,
    )
    if got == want:
        tally.usage_ok += 1
    else:
        tally.usage_bad.append(f"(prompt, completion, streamed) {got} != {want}")
    return 0.0


async def client_loop(
    http, url: str, model: str, a: argparse.Namespace, *, rng: random.Random, end: float,
    budget: list[int], tally: Tally,
) -> None:  # fmt: skip
    while time.monotonic() < end and budget[0] > 0:
        budget[0] -= 1
        n = rng.randint(a.min_prompt, a.max_prompt)
        prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]
        wait = await one_request(http, url, model, prompt, a.max_tokens, tally)
        if wait:
            await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))


async def run_load(url: str, a: argparse.Namespace, pids: dict[str, int]) -> dict[str, Any]:
    sampler = MemorySampler(pids)
    tally = Tally()
    conn = aiohttp.TCPConnector(limit=a.clients, limit_per_host=a.clients)
    timeout = aiohttp.ClientTimeout(total=a.request_timeout, sock_connect=10)
    budget = [a.max_requests]
    sampling = asyncio.create_task(sampler.run())
    started = time.monotonic()
    end = started + a.duration
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        async with http.get(f"{url}/v1/models") as r:
            model = a.model or (await r.json())["data"][0]["id"]
        clients = [
            client_loop(
                http,
                url,
                model,
                a,
                rng=random.Random(a.seed * 100_003 + i),
                end=end,
                budget=budget,
                tally=tally,
            )
            for i in range(a.clients)
        ]
        tasks = [asyncio.ensure_future(c) for c in clients]
        # Requests still running `grace` seconds after the end are cut off (not errors):
        # the run stays bounded in time whatever the server does.
        _, late = await asyncio.wait(tasks, timeout=a.duration + a.grace)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    elapsed = time.monotonic() - started
    sampling.cancel()
    sampler.sample()
    statuses = dict(sorted(tally.status.items()))
    return {
        "url": url,
        "clients": a.clients,
        "duration_s": round(elapsed, 1),
        "drain_s": round(max(0.0, elapsed - a.duration), 1),
        "requests_sent": tally.sent,
        "requests_completed": tally.completed,
        "requests_cut_off": len(late),
        "completed_usage_correct": tally.usage_ok,
        "usage_mismatches": len(tally.usage_bad),
        "http_status": {str(k): v for k, v in statuses.items()},
        "http_429": tally.status[429],
        "http_503": tally.status[503],
        "throttled_without_retry_after": tally.no_retry_after,
        "server_errors_5xx": len(tally.server_errors),
        "other_errors": len(tally.other_errors),
        "tokens_streamed": tally.tokens,
        "output_tokens_per_s": round(tally.tokens / elapsed, 1) if elapsed else 0.0,
        "ttft_p50_s": _round(percentile(tally.ttft, 50)),
        "ttft_p99_s": _round(percentile(tally.ttft, 99)),
        "memory": sampler.report(),
        "samples": {
            "usage": tally.usage_bad[:5],
            "server_errors": tally.server_errors[:5],
            "other_errors": tally.other_errors[:5],
        },
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class OwnCluster:
    """nats-server, prefill and decode workers, and a router, on loopback; stopped by pid."""

    def __init__(self, a: argparse.Namespace, workdir: Path):
        self.a, self.workdir = a, workdir
        self.nats: NatsServer | None = None
        self.cluster: LocalCluster | None = None
        self.url = ""

    async def start(self) -> dict[str, int]:
        a = self.a
        self.nats = NatsServer(self.workdir / "nats").start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        env["TANDEM_LOG_FORMAT"] = "json"
        env["TANDEM_LOG_LEVEL"] = "warning"
        self.cluster = LocalCluster(self.nats.url, env=env, capture=self.workdir / "logs")
        for role, count in (("prefill", a.prefill), ("decode", a.decode)):
            extra = [*(a.worker_arg or []), *(getattr(a, f"{role}_arg") or [])]
            for i in range(1, count + 1):
                self.cluster.start_one(role, "--service-id", f"{role[0]}{i}", *WORKER_ARGS,
                                       *extra, label=f"{role}-{i}")  # fmt: skip
        port = free_port()
        self.cluster.start_one("router", "--service-id", "router-load", "--port", str(port),
                               *(a.router_arg or []))  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        await wait_healthy(self.url, {"prefill": a.prefill, "decode": a.decode},
                           self.cluster.procs, a.start_timeout)  # fmt: skip
        pids = {label: p.pid for label, p in self.cluster.procs.items()}
        pids["nats-server"] = self.nats.proc.pid
        return pids

    def stop(self) -> dict[str, int]:
        codes = self.cluster.stop() if self.cluster is not None else {}
        if self.nats is not None:
            self.nats.stop()
        return codes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--url", default="", help="a running router (http://host:port); "
                   "default: start an own cluster on loopback")  # fmt: skip
    p.add_argument("--pids", default="", help="with --url: name=pid,... to sample RSS of")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument(
        "--max-requests", type=int, default=100_000, help="requests at most, all clients"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--min-prompt", type=int, default=16, help="shortest prompt, tokens")
    p.add_argument("--max-prompt", type=int, default=256, help="longest prompt, tokens")
    p.add_argument(
        "--grace",
        type=float,
        default=240.0,
        help="seconds after --duration before requests still running are cut off",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=1, help="own cluster: prefill workers")
    p.add_argument("--decode", type=int, default=1, help="own cluster: decode workers")
    p.add_argument("--worker-arg", action="append", help="own cluster: extra worker flag "
                   "(repeat; e.g. --worker-arg=--kv-cache-mb --worker-arg=256)")  # fmt: skip
    p.add_argument("--prefill-arg", action="append", help="own cluster: prefill-only flag")
    p.add_argument("--decode-arg", action="append", help="own cluster: decode-only flag "
                   "(e.g. --decode-arg=--max-queue-delay --decode-arg=0)")  # fmt: skip
    p.add_argument("--router-arg", action="append", help="own cluster: extra router flag")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--keep-logs", action="store_true", help="own cluster: keep its logs")
    p.add_argument("--json", type=Path, help="also write the report here")
    return p


def _validate(a: argparse.Namespace) -> None:
    for name in ("clients", "max_requests", "max_tokens", "min_prompt", "prefill", "decode"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    if a.max_prompt < a.min_prompt:
        raise ValueError("--max-prompt: must be >= --min-prompt")
    if a.duration <= 0 or a.request_timeout <= 0 or a.grace < 0:
        raise ValueError("--duration/--request-timeout: must be > 0, --grace >= 0")


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    if a.url:
        pids = {}
        for item in filter(None, a.pids.split(",")):
            name, _, pid = item.partition("=")
            pids[name] = int(pid)
        return await run_load(a.url.rstrip("/"), a, pids)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-load-"))
    own = OwnCluster(a, workdir)
    try:
        pids = await own.start()
        report = await run_load(own.url, a, pids)
    finally:
        codes = own.stop()
    report["exit_codes"] = codes
    report["logs"] = str(workdir / "logs") if a.keep_logs else None
    if not a.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        _validate(a)
        report = event_loop.run(_main(a))
    except ValueError as e:
        print(f"bench.load: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    ok = report["server_errors_5xx"] == 0 and report["throttled_without_retry_after"] == 0
    return 0 if ok and report["usage_mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
