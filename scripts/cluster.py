"""The whole system as local processes: `make run` (that is, `python -m scripts.cluster`).

Starts a nats-server (JetStream on, port 4222 by default), then cache_master, cache_store,
prefill, decode and router, each as `python -m services.<name>`; waits until every one
answers micro discovery; prints where the router listens; and on Ctrl-C (or SIGTERM) stops
them in reverse order with SIGTERM, then the nats-server, leaving nothing running.
Tests use `LocalCluster` to start the same processes against their own nats-server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats

from libs.common.bus import discover
from scripts.nats_server import NatsServer

SERVICES = ("cache_master", "cache_store", "prefill", "decode", "router")
REPO = Path(__file__).resolve().parent.parent


class LocalCluster:
    """Service processes started by this object, and only those, stopped by their pids."""

    def __init__(
        self,
        nats_url: str,
        args: dict[str, list[str]] | None = None,
        env: dict[str, str] | None = None,
        capture: Path | None = None,
    ):
        self.nats_url = nats_url
        self.args = args or {}
        self.env = {**os.environ, **(env or {})}
        self.capture = capture
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, names: tuple[str, ...] = SERVICES) -> None:
        for name in names:
            self.start_one(name)

    def start_one(self, name: str, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", f"services.{name}", "--nats-url", self.nats_url]
        cmd += [*self.args.get(name, []), *extra]
        out = None
        if self.capture is not None:
            self.capture.mkdir(parents=True, exist_ok=True)
            out = open(self.capture / f"{name}.log", "ab")
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # Ctrl-C reaches only the launcher, which stops in order
        )
        if out is not None:
            out.close()
        self.procs[name] = proc
        return proc

    async def wait_ready(self, timeout: float = 60.0) -> list[dict]:
        """Wait until every started service answers `$SRV.PING`; raise if one exits."""
        wanted = {f"tandem-{name}" for name in self.procs}
        nc = await nats.connect(self.nats_url, connect_timeout=5, max_reconnect_attempts=5)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited with {proc.returncode} during start")
                replies = await discover(nc, timeout=0.3)
                if wanted <= {r.get("name") for r in replies}:
                    return replies
            raise TimeoutError(f"services not ready within {timeout}s: {sorted(wanted)}")
        finally:
            await nc.close()

    def stop(self, timeout: float = 20.0) -> dict[str, int]:
        """SIGTERM in reverse start order; kill what outlives `timeout`. Returns exit codes."""
        codes: dict[str, int] = {}
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        return codes


async def _run(args: argparse.Namespace) -> int:
    nats_server = NatsServer(REPO / "run" / "nats", port=args.nats_port, monitor_port=8222)
    try:
        nats_server.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"cannot start nats-server on port {args.nats_port}: {e}", file=sys.stderr)
        return 1
    cluster = LocalCluster(nats_server.url, args={"router": ["--port", str(args.router_port)]})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        cluster.start()
        await cluster.wait_ready(timeout=args.ready_timeout)
        print(
            f"\nTandem is up: router at http://127.0.0.1:{args.router_port} "
            f"(GET /health); NATS at {nats_server.url}, monitoring http://127.0.0.1:8222\n"
            "Ctrl-C stops everything.\n",
            flush=True,
        )
        while not stop.is_set():
            dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
            if dead:
                print(f"{', '.join(dead)} exited; stopping the rest", file=sys.stderr)
                code = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                pass
    except (RuntimeError, TimeoutError) as e:
        print(f"start failed: {e}", file=sys.stderr)
        code = 1
    finally:
        codes = cluster.stop()
        nats_server.stop()
        print(f"stopped: {codes}", flush=True)
    return code


def main() -> None:
    parser = argparse.ArgumentParser(prog="make run", description=__doc__.splitlines()[0])
    parser.add_argument("--nats-port", type=int, default=int(os.environ.get("NATS_PORT", 4222)))
    parser.add_argument(
        "--router-port",
        type=int,
        default=int(os.environ.get("TANDEM_ROUTER_PORT", os.environ.get("TANDEM_PORT", 8000))),
        help="router HTTP port (env TANDEM_ROUTER_PORT; default 8000)",
    )
    parser.add_argument("--ready-timeout", type=float, default=120.0)
    sys.exit(asyncio.run(_run(parser.parse_args())))


if __name__ == "__main__":
    main()
