"""The whole system as local processes: `make run` (that is, `python -m scripts.cluster`).

Starts a nats-server (JetStream on, port 4222 by default) that knows one identity per
process (scripts/identities.py, kept in run/secrets: each its own password and subject
permissions, bound to its service id), then the topology of compose.yaml: cache_master,
two cache_stores, prefill, decode and router (`--routers N`: N of them, active-active, on
ports 8000, 8001...), each as `python -m services.<name>` with its
own credentials file, configured by the same TANDEM_* environment variables; streams
their logs to the terminal, each line prefixed by the service; waits until every one answers
micro discovery; prints where the router listens; restarts a service that exits while it
runs, with a backoff, as compose's `restart: unless-stopped` does (scripts/supervisor.py:
one that keeps exiting right after its start is given up); and on Ctrl-C (or SIGTERM)
stops them in reverse order with SIGTERM, then the nats-server, leaving nothing running.
Tests use `LocalCluster` to start the same processes against their own nats-server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import nats

from libs.common import event_loop
from libs.common.bus.connection import discover
from libs.common.bus.credentials import connect_options
from scripts.identities import AUTH_CONF, Identity, ensure
from scripts.nats_server import NatsServer
from scripts.supervisor import RestartPolicy, Supervisor

SERVICES = ("cache_master", "cache_store", "prefill", "decode", "router")
REPO = Path(__file__).resolve().parent.parent
# `make run`: (label, service, extra flags), the processes of compose.yaml.
TOPOLOGY = (
    ("cache_master", "cache_master", ("--service-id", "master-1")),
    # A standby: it takes over within seconds if master-1 dies (docs/pool.md, "Master
    # failover"); a deposed master exits and is started again as a standby (supervisor.py).
    ("cache_master_2", "cache_master", ("--service-id", "master-2")),
    ("cache_store_1", "cache_store", ("--service-id", "store-1")),
    ("cache_store_2", "cache_store", ("--service-id", "store-2")),
    ("prefill", "prefill", ("--service-id", "prefill-1")),
    ("decode", "decode", ("--service-id", "decode-1")),
    ("router", "router", ("--service-id", "router-1")),
)
Spec = tuple[str, str, tuple[str, ...]]


def topology(routers: int = 1) -> tuple[Spec, ...]:
    """TOPOLOGY with `routers` routers: `router` (router-1), then `router_2` (router-2)..."""
    more = tuple((f"router_{k}", "router", ("--service-id", f"router-{k}"))
                 for k in range(2, routers + 1))  # fmt: skip
    return TOPOLOGY + more


def identities(specs: tuple[Spec, ...]) -> tuple[Identity, ...]:
    """One NATS identity per process, bound to its service id, and the operator's
    (read-only)."""
    return (*(Identity(label, service, extra[1]) for label, service, extra in specs),
            Identity("cli", "cli"))  # fmt: skip


PLANNED = 8  # `make run --planner`: ids <role>-p1..p8 its local actuator may start


def with_planner(specs: tuple[Spec, ...], secrets: Path) -> tuple[tuple[Spec, ...], tuple]:
    """`make run --planner`: the planner with the local actuator, and identities for the
    workers it may start (each bound to its id; services/planner/actuators.py)."""
    flags = ("--service-id", "planner-1", "--actuator", "local",
             "--local-credentials-dir", str(secrets))  # fmt: skip
    workers = tuple(Identity(f"{role}-p{n}", role, f"{role}-p{n}")
                    for role in ("prefill", "decode") for n in range(1, PLANNED + 1))  # fmt: skip
    return (*specs, ("planner", "planner", flags)), workers


def router_ports(routers: int, first: int) -> dict[str, list[str]]:
    """Each router's --port: `first` for `router`, then first + 1, ... (0: each a free one)."""
    labels = ["router", *(f"router_{k}" for k in range(2, routers + 1))]
    return {label: ["--port", str(first + k if first else 0)] for k, label in enumerate(labels)}


IDENTITIES = identities(TOPOLOGY)
_COLORS = ("36", "33", "35", "32", "34", "31", "96", "93")


class LogPrefixer:
    """Copies each process's output line by line to one stream, prefixed by its label.

    One reader thread per process; a lock keeps lines whole. Colors only on a terminal.
    """

    def __init__(self, out: IO[str] = sys.stdout, width: int = 13):
        self.out, self.width = out, width
        self.color = out.isatty()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def follow(self, label: str, stream: IO[bytes]) -> None:
        prefix = f"{label:<{self.width}}| "
        if self.color:
            code = _COLORS[len(self._threads) % len(_COLORS)]
            prefix = f"\033[{code}m{prefix}\033[0m"
        thread = threading.Thread(
            target=self._copy, args=(prefix, stream), name=f"log-{label}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _copy(self, prefix: str, stream: IO[bytes]) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                with self._lock:
                    self.out.write(prefix + line + "\n")
                    self.out.flush()

    def join(self, timeout: float = 5.0) -> None:
        """Wait for the readers to reach the end of their (exited) processes' output."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class LocalCluster:
    """Service processes started by this object, and only those, stopped by their pids."""

    def __init__(
        self,
        nats_url: str,
        args: dict[str, list[str]] | None = None,
        env: dict[str, str] | None = None,
        capture: Path | None = None,
        prefix: LogPrefixer | None = None,
        credentials: Mapping[str, Path] | None = None,
        *,
        repo: Path = REPO,
    ):
        """`capture`: each service's output to <capture>/<label>.log; else `prefix`: to one
        stream, line by line, prefixed by the label; else inherited (the terminal).
        `credentials`: label -> NATS credentials file (scripts/identities.py); the one
        labelled `cli` is what `wait_ready` connects as. `repo`: the checkout whose
        services run (another one: a benchmark against older code, same interpreter)."""
        self.nats_url, self.repo = nats_url, repo
        self.credentials = dict(credentials or {})
        self.args = args or {}
        self.env = {**os.environ, **(env or {})}
        self.capture = capture
        self.prefix = prefix
        self.procs: dict[str, subprocess.Popen] = {}
        self.services: dict[str, str] = {}  # label -> service, where they differ

    def start(self, names: tuple[str, ...] = SERVICES) -> None:
        for name in names:
            self.start_one(name)

    def start_one(self, name: str, *extra: str, label: str | None = None) -> subprocess.Popen:
        """Start `services.<name>`; it is `procs[label]` (default: the name)."""
        label = label or name
        # The URL may carry NATS credentials: the environment of the child (readable only by
        # its user), not its command line (which `ps` shows to everyone).
        env = {**self.env, f"TANDEM_{name.upper()}_NATS_URL": self.nats_url}
        if label in self.credentials:
            env[f"TANDEM_{name.upper()}_NATS_CREDENTIALS_FILE"] = str(self.credentials[label])
        cmd = [sys.executable, "-m", f"services.{name}"]
        cmd += [*self.args.get(label, self.args.get(name, [])), *extra]
        out = None
        if self.capture is not None:
            self.capture.mkdir(parents=True, exist_ok=True)
            out = open(self.capture / f"{label}.log", "ab")
        elif self.prefix is not None:
            out = subprocess.PIPE
        proc = subprocess.Popen(
            cmd,
            cwd=self.repo,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # Ctrl-C reaches only the launcher, which stops in order
        )
        if out is subprocess.PIPE:
            self.prefix.follow(label, proc.stdout)
        elif out is not None:
            out.close()
        self.procs[label] = proc
        if label != name:
            self.services[label] = name
        return proc

    async def wait_ready(self, timeout: float = 60.0) -> list[dict]:
        """Wait until every started service answers `$SRV.PING`; raise if one exits."""
        wanted = {f"tandem-{self.services.get(label, label)}" for label in self.procs}
        identity = connect_options(self.nats_url, str(self.credentials.get("cli", "")))
        nc = await nats.connect(self.nats_url, connect_timeout=5, max_reconnect_attempts=5,
                                **identity)  # fmt: skip
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
        """SIGTERM in tiers (router and workers, then stores, then the master), so each
        tier still finds what it unregisters from; kill what outlives `timeout`.
        Returns exit codes."""
        codes: dict[str, int] = {}
        deadline = time.monotonic() + timeout

        def tier(label: str) -> int:
            service = self.services.get(label, label)
            return {"cache_store": 1, "cache_master": 2}.get(service, 0)

        for level in (0, 1, 2):
            names = [n for n in reversed(list(self.procs)) if tier(n) == level]
            for name in names:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            for name in names:
                proc = self.procs[name]
                try:
                    codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes[name] = proc.wait()
        self.procs.clear()
        self.services.clear()
        return codes


def worker_threads(environ: Mapping[str, str]) -> dict[str, str]:
    """Torch threads for the two model workers sharing this host: half the cores this
    process may use each (at least 1), so their OpenMP regions do not oversubscribe the
    cores (docs/engine.md, "Threads and shared cores"). A value in the environment wins."""
    half = str(max(1, len(os.sched_getaffinity(0)) // 2))
    names = ("TANDEM_PREFILL_NUM_THREADS", "TANDEM_DECODE_NUM_THREADS")
    return {name: half for name in names if not environ.get(name)}


def kv_secret_file(environ: Mapping[str, str], run_dir: Path) -> dict[str, str]:
    """The pool's KV secret for `make run`: TANDEM_KV_SECRET_FILE if set, else run/kv.secret,
    made once (32 random bytes, hex, mode 0600) and kept, so objects in a kept segment file
    stay readable across runs. The services get the path through their environment."""
    if environ.get("TANDEM_KV_SECRET_FILE"):
        return {}
    path = run_dir / "kv.secret"
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
    return {"TANDEM_KV_SECRET_FILE": str(path)}


async def _run(args: argparse.Namespace) -> int:
    # NATS refuses clients without an identity: one per process, made once in run/secrets
    # (0600) and kept; the services get the path of theirs through their environment.
    run_dir: Path = args.run_dir
    specs_run, planned = topology(args.routers), ()
    if args.planner:
        specs_run, planned = with_planner(specs_run, run_dir / "secrets")
    try:
        credentials = ensure(run_dir / "secrets", (*identities(specs_run), *planned),
                             kv_secret=False)  # fmt: skip
    except (OSError, ValueError) as e:
        print(f"cannot make the NATS identities in {run_dir / 'secrets'}: {e}", file=sys.stderr)
        return 1
    nats_server = NatsServer(run_dir / "nats", port=args.nats_port,
                             monitor_port=args.nats_monitor_port or None,
                             config_file=run_dir / "secrets" / AUTH_CONF)  # fmt: skip
    try:
        nats_server.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"cannot start nats-server on port {args.nats_port}: {e}", file=sys.stderr)
        return 1
    prefixer = LogPrefixer()
    env = {} if os.environ.get("TANDEM_LOG_FORMAT") else {"TANDEM_LOG_FORMAT": "console"}
    env.update(worker_threads(os.environ))
    env.update(kv_secret_file(os.environ, run_dir))
    cluster = LocalCluster(
        nats_server.url,
        args=router_ports(args.routers, args.router_port),
        env=env,
        prefix=prefixer,
        credentials=credentials,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        for label, service, extra in specs_run:
            cluster.start_one(service, *extra, label=label)
        await cluster.wait_ready(timeout=args.ready_timeout)
        monitor = f", monitoring http://127.0.0.1:{nats_server.monitor_port}"
        more = [f"http://127.0.0.1:{args.router_port + k}" for k in range(1, args.routers)]
        print(
            f"\nTandem is up: router at http://127.0.0.1:{args.router_port} "
            f"{'(and ' + ', '.join(more) + ') ' if more else ''}"
            f"(GET /health); NATS at {nats_server.url}"
            f"{monitor if nats_server.monitor_port else ''}; the operator's NATS identity "
            f"(read-only): {credentials['cli']}\nCtrl-C stops everything.\n",
            flush=True,
        )
        specs = {label: (service, extra) for label, service, extra in specs_run}
        supervisor = Supervisor(
            cluster.procs,
            lambda label: cluster.start_one(specs[label][0], *specs[label][1], label=label),
            RestartPolicy(backoff=args.restart_backoff, tries=args.restart_tries),
        )
        while not stop.is_set():
            supervisor.poll()
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.25)
            except TimeoutError:
                pass
    except (RuntimeError, TimeoutError) as e:
        print(f"start failed: {e}", file=sys.stderr)
        code = 1
    finally:
        codes = cluster.stop()
        prefixer.join()
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
    parser.add_argument(
        "--routers",
        type=int,
        default=int(os.environ.get("TANDEM_ROUTERS", 1)),
        help="routers to start, active-active: router-1 on --router-port, router-2 on the "
        "next port... (env TANDEM_ROUTERS; default 1; docs/operations.md, 'Several routers')",
    )
    parser.add_argument(
        "--planner", action="store_true",
        help="also run the planner with the local actuator: it starts and stops prefill and "
        "decode workers on this host (docs/operations.md, 'Planner')",
    )  # fmt: skip
    parser.add_argument(
        "--nats-monitor-port",
        type=int,
        default=int(os.environ.get("NATS_MONITOR_PORT") or 0),
        help="serve nats-server's monitoring on 127.0.0.1:PORT (env NATS_MONITOR_PORT; "
        "default 0: off)",
    )
    parser.add_argument("--run-dir", type=Path, default=REPO / "run",
                        help="where NATS data, identities and the KV secret are kept")  # fmt: skip
    parser.add_argument("--ready-timeout", type=float, default=120.0)
    parser.add_argument(
        "--restart-backoff", type=float, default=1.0,
        help="seconds before a service that exited is started again, doubled for each exit "
        "in a row within 30 s of its start (at most 30 s)",
    )  # fmt: skip
    parser.add_argument(
        "--restart-tries", type=int, default=5,
        help="a service that exits this many times in a row within 30 s of its start is "
        "given up (the rest keeps running)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.restart_backoff <= 0 or args.restart_tries < 1:
        parser.error("--restart-backoff must be > 0 and --restart-tries >= 1")
    if not 1 <= args.routers <= 16:
        parser.error("--routers must be 1 to 16")
    sys.exit(event_loop.run(_run(args)))


if __name__ == "__main__":
    main()
