"""What tracing costs: the same serving load with tracing off and on, in one run.

    python -m bench.tracing                                # 32 streams, 2 rounds
    python -m bench.tracing --rounds 3 --json tracing.json
    python -m bench.tracing --micro                        # µs per span, in-process

Each configuration is a fresh cluster of the same build (its own nats-server, 2 prefill
workers, 1 decode worker, a router; the default model; tcp transport), measured with
bench.serve's `random` workload, and stopped:

    off     no --otlp-endpoint (the default)
    on      every service exports to an OTLP/HTTP sink in this process, which counts what
            it gets and answers as a collector does (it decodes nothing: its cost is not
            the services')
    before  with --before DIR only: the services of another checkout (the code before
            tracing, e.g. `git worktree add DIR 724cdb4^`), same interpreter and flags

Rounds alternate (before, off, on, before, off, on, ...) so that a drift of the shared
host's load lands on each; the table gives each configuration's mean over its rounds, on /
off and off / before.
`--micro` times the helpers themselves in this process instead (libs/common/tracing.py):
a span off, a span on (into an exporter that drops it) and the traceparent header.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import timeit
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExportResult

from bench import report
from bench.client import Endpoint
from bench.deployments import Deployment, Topology
from bench.serve import add_workload_args, benchmark, make_arrivals, make_workload, served_model
from libs.common import event_loop, tracing
from scripts.cluster import REPO

METRICS = (("output_throughput", "output tok/s"), ("ttft_ms", "mean TTFT ms"),
           ("tpot_ms", "mean TPOT ms"), ("e2e_ms", "mean E2E ms"))  # fmt: skip


class Sink:
    """An OTLP/HTTP endpoint that counts export requests and their bytes."""

    def __init__(self) -> None:
        self.requests = self.bytes = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._export)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests, self.bytes = self.requests + 1, self.bytes + len(body)
        # an empty ExportTraceServiceResponse is zero bytes of protobuf
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def topology(name: str, a: argparse.Namespace, sink: Sink) -> Topology:
    traced = ["--otlp-endpoint", sink.url] if name == "on" else []
    workers = ["--num-threads", str(a.threads), "--transport", "tcp", "--no-pool", "true",
               *traced]  # fmt: skip
    return Topology(name, 2, 1, workers, {}, router_args=traced, note=f"tracing {name}")


async def run_one(name: str, a: argparse.Namespace, sink: Sink, round_: int) -> dict[str, Any]:
    workdir = a.workdir / f"{name}-{round_}"
    shutil.rmtree(workdir, ignore_errors=True)  # no KV events of an earlier run
    system = Deployment(topology(name, a, sink), workdir,
                        repo=a.before if name == "before" else REPO)  # fmt: skip
    exported = sink.requests
    try:
        await system.start(a.ready_timeout)
        endpoint = Endpoint(system.url, await served_model(system.url), timeout=300)
        warm = make_workload(argparse.Namespace(**{**vars(a), "num_prompts": 1,
                                                   "input_len": 16, "seed": 999}))  # fmt: skip
        await benchmark(endpoint, warm, make_arrivals(a), progress=False)
        run = await benchmark(endpoint, make_workload(a), make_arrivals(a), None,
                              not a.no_progress, label=f"{name} {round_}")  # fmt: skip
    finally:  # in a thread: the services' last exports at their exit reach the sink here
        await asyncio.to_thread(system.stop)
    run["exports"] = sink.requests - exported
    run["load"] = os.getloadavg()
    return run


def micro(n: int = 100_000) -> dict[str, float]:
    """µs per call of the tracing helpers, off and on (spans into an exporter that drops
    them: what the services pay, without the export thread's encoding)."""

    class Drop:
        def export(self, spans: Any) -> Any:
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

    def one_span() -> None:
        with tracing.span("x", "r", a=1):
            tracing.headers()

    out = {"off_span_us": timeit.timeit(one_span, number=n) / n * 1e6}
    tracing.setup("bench", "bench", "", exporter=Drop())
    try:
        with tracing.span("root", "r", context=tracing.joined(None)):
            out["on_span_us"] = timeit.timeit(one_span, number=n // 10) / (n // 10) * 1e6
    finally:
        tracing.shutdown()
    return out


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def mean(name: str, key: str) -> float:
        values = [r["summary"][key] for r in runs[name]]
        values = [v["mean"] if isinstance(v, dict) else v for v in values]
        return sum(values) / len(values)

    names = [n for n in ("before", "off", "on") if runs.get(n)]
    ratios = [("on", "off")] + ([("off", "before")] if "before" in names else [])
    lines = [f"{'':16}" + "".join(f"{n:>12}" for n in names)
             + "".join(f"{f'{x} / {y}':>14}" for x, y in ratios)]  # fmt: skip
    for key, label in METRICS:
        means = {n: mean(n, key) for n in names}
        lines.append(f"{label:16}" + "".join(f"{means[n]:12.1f}" for n in names)
                     + "".join(f"{means[x] / means[y]:14.3f}" for x, y in ratios))  # fmt: skip
    done = {n: sum(r["summary"]["completed"] for r in rs) for n, rs in runs.items()}
    lines.append(f"completed: {done}; exports to the sink (on): "
                 f"{sum(r['exports'] for r in runs['on'])}")  # fmt: skip
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.tracing",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--workdir", type=Path, default=REPO / "run" / "bench-tracing")
    p.add_argument("--json", type=Path, help="write every round's results")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--micro", action="store_true", help="only time the helpers, in-process")
    p.add_argument("--before", type=Path, help="a checkout of older code: also run its services")
    add_workload_args(p)
    p.set_defaults(workload="random", num_prompts=96, input_len=256, output_len=32,
                   max_concurrency=32, duration=900.0)  # fmt: skip
    return p


async def _main(a: argparse.Namespace) -> int:
    if a.micro:
        print(json.dumps({k: round(v, 3) for k, v in micro().items()}))
        return 0
    if a.rounds < 1 or a.threads < 1:
        raise ValueError("--rounds and --threads must be >= 1")
    make_workload(a), make_arrivals(a)  # flag errors before any start
    if a.before is not None and not (a.before / "services" / "router").is_dir():
        raise ValueError(f"--before {a.before}: not a checkout of this repository")
    sink = Sink()
    await sink.start()
    names = ("before", "off", "on") if a.before is not None else ("off", "on")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for round_ in range(a.rounds):
            for name in names:
                print(f"== {name} round {round_} (load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)  # fmt: skip
                runs[name].append(await run_one(name, a, sink, round_))
    finally:
        await sink.stop()
    print(table(runs))
    if a.json:
        report.write_json(a.json, {"args": {k: str(v) for k, v in vars(a).items()}, "runs": runs})
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return event_loop.run(_main(a))
    except ValueError as e:
        print(f"bench.tracing: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
