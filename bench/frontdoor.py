"""The front door under attack and overload: what one hostile client costs everyone else.

    python -m bench.frontdoor --json frontdoor.json            # a stack of its own
    python -m bench.frontdoor --base-url http://127.0.0.1:8000/v1 --api-key KEY

Part 1, hostile inputs (bench/frontdoor_cases.py). For each: two greedy chat streams are
started, then the hostile request is sent while a separate process polls GET /health every
20 ms (its own process, so nothing the bench does delays the poll). Reported per case: the
router's answer (status, seconds), the /health p99 and max over the case's window, and
whether both streams finished with the text they give alone. Then a thousand sockets that
never finish a request are held open meanwhile, the same way.

Fairness: a light client's five requests, one at a time, alone and then beside a flood of
32 closed-loop streams from another key (another tenant, in a stack of its own: the bench
writes a .toml keys file of three tenants). The issue measured 14.7x before tenants.

Part 2, overload: closed-loop clients (each sends its next request when the last ends;
after a 429 it waits Retry-After, at most 1 s) at capacity, 2x and 4x. Goodput is the
requests per second that finished with TTFT under --ttft-slo; a refusal is a 429 and its
latency is measured. Goals (issue 39): every hostile case refused or served with the
/health p99 under 100 ms and both streams correct; at 4x every excess request answered 429
within 50 ms; goodput at 2x >= 90% of goodput at capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.client
import multiprocessing as mp
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import report
from bench.deployments import Deployment, Topology
from bench.frontdoor_cases import cases, hold_slow_sockets
from bench.frontdoor_load import fairness, overload, pct, stream_chat
from libs.common import event_loop

POLL_S = 0.02


def _poll(host: str, port: int, conn: Any) -> None:
    """The poller (a child process): GET /health every POLL_S until told to stop; sends
    back [(start, seconds)] with CLOCK_MONOTONIC times (shared by the processes)."""
    out: list[tuple[float, float]] = []
    client = http.client.HTTPConnection(host, port, timeout=30)
    while not conn.poll():
        t0 = time.monotonic()
        try:
            client.request("GET", "/health")
            client.getresponse().read()
        except (OSError, http.client.HTTPException):
            client.close()
            client = http.client.HTTPConnection(host, port, timeout=30)
        out.append((t0, time.monotonic() - t0))
        time.sleep(max(0.0, POLL_S - (time.monotonic() - t0)))
    conn.send(out)


class Poller:
    def __init__(self, base: str):
        host, port = base.removeprefix("http://").split("/")[0].split(":")
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=_poll, args=(host, int(port), child))
        self._proc.start()

    def stop(self) -> list[tuple[float, float]]:
        self._conn.send("stop")
        polls = self._conn.recv()
        self._proc.join(10)
        return polls


def window(polls: list[tuple[float, float]], start: float, end: float) -> dict[str, float]:
    """/health latency (ms) of the polls that started in [start, end] or overlapped it."""
    ms = [s * 1e3 for t, s in polls if t <= end and t + s >= start]
    p99, worst = pct(ms, 0.99), max(ms or [0.0])
    return {"polls": len(ms), "p99_ms": round(p99, 1), "max_ms": round(worst, 1)}


def _same(got: dict[str, Any], ref: dict[str, Any]) -> bool:
    return got["status"] == 200 and got["text"] == ref["text"] and got["finish"] == ref["finish"]


async def hostile(base: str, model: str, headers: dict, slow_sockets: int, hold_s: float,
                  only: list[str]) -> dict:  # fmt: skip
    poller = Poller(base)
    results: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=300)
    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
            ref = await stream_chat(http, base, model, headers, 48)
            print(f"reference stream: {ref['status']} {ref['finish']}", file=sys.stderr)
            for case in cases(model):
                if only and case.name not in only:
                    continue
                streams = [asyncio.ensure_future(stream_chat(http, base, model, headers, 48))
                           for _ in range(2)]  # fmt: skip
                await asyncio.sleep(0.3)
                start = time.monotonic()
                sent = await case.send(http, base, headers)
                end = time.monotonic()
                done = await asyncio.gather(*streams)
                results[case.name] = {
                    "what": case.what,
                    "statuses": sorted(set(sent.statuses)),
                    "answered_s_max": round(max(sent.seconds), 3),
                    "window": (start, end + 0.2),
                    "streams_ok": all(_same(d, ref) for d in done),
                    **({"note": sent.note} if sent.note else {}),
                }
                print(f"{case.name}: {results[case.name]['statuses']} "
                      f"in {results[case.name]['answered_s_max']} s", file=sys.stderr)  # fmt: skip
            host, port = base.removeprefix("http://").split("/")[0].split(":")
            auth = headers.get("Authorization", "")
            streams = [asyncio.ensure_future(stream_chat(http, base, model, headers, 48))
                       for _ in range(2)]  # fmt: skip
            start = time.monotonic()
            held = asyncio.ensure_future(
                hold_slow_sockets(host, int(port), slow_sockets, hold_s, auth)
            )
            await asyncio.sleep(min(5.0, hold_s / 2))
            during = await stream_chat(http, base, model, headers, 8, "Hello")
            held_result = await held
            done = await asyncio.gather(*streams)
            results["slow_sockets"] = {
                "what": f"{slow_sockets} sockets that never finish a request, held {hold_s} s",
                **held_result,
                "request_during": during["status"],
                "window": (start, time.monotonic()),
                "streams_ok": all(_same(d, ref) for d in done),
            }
    finally:
        polls = poller.stop()
    for r in results.values():
        r.update(health=window(polls, *r.pop("window")))
    return results


def verdicts(res: dict[str, Any]) -> dict[str, bool]:
    """The issue's goals, per run: each hostile case refused (4xx) or served (200), never a
    5xx, /health p99 under 100 ms and both streams correct; the slow sockets all closed by
    the router; at 4x some requests refused, each 429 within 50 ms; goodput at 2x (and 4x)
    at least 90% of goodput at capacity."""
    v: dict[str, bool] = {}
    for name, r in res.get("hostile", {}).items():
        no_5xx = all(s < 500 for s in r.get("statuses", []) if s)
        v[f"{name}: no 5xx, /health p99 < 100 ms, streams correct"] = (
            no_5xx and r["health"]["p99_ms"] < 100 and r["streams_ok"]
        )
        if "closed_by_router" in r:
            v[f"{name}: every socket closed by the router"] = r["closed_by_router"] == r["opened"]
    ov = res.get("overload")
    if ov:
        four = ov["4x"]
        v["4x: excess refused, each 429 within 50 ms"] = (
            four["refused_429"] > 0 and (four["refused_max_ms"] or 0) <= 50
        )
        v["2x goodput >= 90% of 1x"] = ov["goodput_2x_over_1x"] >= 0.9
        v["4x goodput >= 90% of 1x"] = ov["goodput_4x_over_1x"] >= 0.9
    return v


def keys_file(workdir: Path) -> tuple[Path, dict[str, str]]:
    """A .toml keys file with three tenants of weight 1: `bench` (the hostile inputs and the
    overload), `light` and `flood` (fairness); returns it and each tenant's key."""
    keys = {t: f"sk-{t}-" + secrets.token_hex(8) for t in ("bench", "light", "flood")}
    lines = [f"[tenants.{t}]" for t in keys]
    for t, k in keys.items():
        lines += ["[[keys]]", f'hash = "sha256:{hashlib.sha256(k.encode()).hexdigest()}"',
                  f'tenant = "{t}"']  # fmt: skip
    path = workdir / "keys.toml"
    path.write_text("\n".join(lines) + "\n")
    return path, keys


async def run(a: argparse.Namespace) -> dict[str, Any]:
    deployment = None
    keys = {
        "bench": a.api_key,
        "light": a.light_key or a.api_key,
        "flood": a.flood_key or a.api_key,
    }
    if not a.base_url:
        workdir = Path(tempfile.mkdtemp(prefix="frontdoor-"))
        path, keys = keys_file(workdir)
        worker = ["--num-threads", "1", "--transport", "tcp"]
        router = ["--api-keys-file", str(path), "--max-running", str(a.capacity),
                  "--max-queue-wait", str(a.max_queue_wait), *a.router_arg]  # fmt: skip
        if a.one_key:  # a router before issue 39: one key, no tenants, no admission flags
            keys = dict.fromkeys(keys, keys["bench"])
            router = ["--api-key", keys["bench"], *a.router_arg]
        deployment = Deployment(Topology("frontdoor", 1, 1, worker_args=worker,
                                         router_args=router), workdir)  # fmt: skip
        print(f"starting a stack in {workdir}", file=sys.stderr)
        await deployment.start()
    base = a.base_url or (deployment.url if deployment else "")
    auth = {t: {"Authorization": f"Bearer {k}"} if k else {} for t, k in keys.items()}
    headers = auth["bench"]
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res: dict[str, Any] = {"base_url": base, "date": now}
    try:
        if not a.skip_hostile:
            res["hostile"] = await hostile(base, a.model, headers, a.slow_sockets, a.hold, a.only)
        if a.flood:
            res["fairness"] = await fairness(base, a.model, auth["light"], auth["flood"],
                                             a.flood, a.light_requests)  # fmt: skip
            print(f"fairness: {res['fairness']}", file=sys.stderr)
        if not a.skip_overload:
            load = {"seconds": a.seconds, "ttft_slo": a.ttft_slo, "max_tokens": a.max_tokens}
            res["overload"] = await overload(base, a.model, headers, a.capacity, **load)
            res["overload"]["ttft_slo_s"] = a.ttft_slo
    finally:
        if deployment is not None:
            deployment.stop()
    res["verdicts"] = verdicts(res)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.frontdoor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--base-url", default="", help="an existing stack's /v1 (default: start one)")
    p.add_argument("--api-key", default="", help="with --base-url: the key of the requests")
    p.add_argument("--light-key", default="", help="with --base-url: the light client's key")
    p.add_argument("--flood-key", default="", help="with --base-url: the flooding client's key")
    p.add_argument(
        "--max-queue-wait",
        type=float,
        default=2.0,
        help="the router's --max-queue-wait in a stack of its own",
    )
    p.add_argument(
        "--one-key",
        action="store_true",
        help="a stack of its own with one --api-key and no admission flags "
        "(as a router before issue 39 takes)",
    )
    p.add_argument("--flood", type=int, default=32, help="fairness: flood streams (0: skip)")
    p.add_argument("--light-requests", type=int, default=5, help="fairness: light requests")
    p.add_argument("--model", default="default")
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag (repeat)")
    p.add_argument("--slow-sockets", type=int, default=1000)
    p.add_argument("--hold", type=float, default=45.0, help="seconds the slow sockets are held")
    p.add_argument(
        "--capacity",
        type=int,
        default=16,
        help="streams the stack serves at once (its router's --max-running)",
    )
    p.add_argument("--seconds", type=float, default=40.0, help="per overload level")
    p.add_argument("--ttft-slo", type=float, default=3.0, help="goodput's TTFT limit, seconds")
    p.add_argument("--max-tokens", type=int, default=32, help="per overload request")
    p.add_argument("--only", action="append", default=[], help="hostile case to run (repeat)")
    p.add_argument("--skip-hostile", action="store_true")
    p.add_argument("--skip-overload", action="store_true")
    p.add_argument("--json", type=Path, help="write the results here too")
    a = p.parse_args(argv)
    res = event_loop.run(run(a))
    if a.json:
        report.write_json(a.json, res)
    print(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
