"""The systems bench.tiers measures, each started and stopped as local processes.

`Deployment` is one configuration of Tandem: its own nats-server, then (optionally)
cache_master and cache_store, the prefill and decode workers, and a router on a free port
of 127.0.0.1, started with LocalCluster; `start()` returns when the router's /health
reports every worker live. `PeerServer` is another OpenAI-compatible server on the same
model (llama.cpp's server, from llama-cpp-python or its own `llama-server` binary, or
`transformers serve`). Both stop only the processes they started,
by pid, and `stop()` is safe twice and after a failed start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from scripts.cluster import REPO, LocalCluster
from scripts.nats_server import NatsServer


def free_port() -> int:
    """A port free now on 127.0.0.1 (the OS's pick; a race with another process is possible)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Topology:
    """What one configuration runs: worker counts, their flags (common, then per role), the
    pool, router flags."""

    name: str
    prefill: int
    decode: int
    worker_args: list[str] = field(default_factory=list)
    role_args: dict[str, list[str]] = field(default_factory=dict)
    pool: bool = False
    router_args: list[str] = field(default_factory=list)
    note: str = ""
    both: int = 0  # `--role both` workers (their flags: role_args["decode"])
    store_segment: str = ""  # the store's DRAM segment ("": the Deployment's)
    ssd_size: str = ""  # an SSD tier of this size under it, in the workdir ("": none)
    routers: int = 1  # routers active-active, each on its own free port (`urls`)


async def wait_healthy(url: str, workers: dict[str, int], procs: dict, timeout: float) -> None:
    """Poll GET /health until it is 200 with `workers` live per role; raise if a process
    exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start")
            try:
                async with http.get(f"{url}/health") as r:
                    body = await r.json()
                    live = body.get("workers", {})
                    if r.status == 200 and all(live.get(k, 0) >= n for k, n in workers.items()):
                        return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} not healthy with {workers} within {timeout}s: {body}")


class Deployment:
    """One Tandem configuration as local processes; `url` is its API root (…/v1)."""

    def __init__(
        self, topo: Topology, workdir: Path, store_segment: str = "512MiB", repo: Path = REPO
    ):
        """`repo`: the checkout whose services run (LocalCluster's)."""
        self.topo, self.workdir, self.store_segment, self.repo = topo, workdir, store_segment, repo
        self.nats: NatsServer | None = None
        self.cluster: LocalCluster | None = None
        self.url = ""
        self.urls: list[str] = []  # every router's API root; `url` is the first

    async def start(self, timeout: float = 300.0) -> None:
        t = self.topo
        self.nats = NatsServer(self.workdir / "nats")
        self.nats.start()
        logs = self.workdir / "logs"
        self.cluster = LocalCluster(self.nats.url, capture=logs, repo=self.repo)
        if t.pool:
            self.cluster.start_one("cache_master")
            store = ["--segment-size", t.store_segment or self.store_segment]
            if t.ssd_size:
                store += ["--ssd-dir", str(self.workdir / "ssd"), "--ssd-size", t.ssd_size]
            self.cluster.start_one("cache_store", *store)
        for role, count in (("prefill", t.prefill), ("decode", t.decode)):
            for i in range(count):
                label = f"{role[0]}{i + 1}"
                args = [*t.worker_args, *t.role_args.get(role, [])]
                self.cluster.start_one(role, "--service-id", label, *args, label=label)
        for i in range(t.both):
            args = [*t.worker_args, *t.role_args.get("decode", []), "--role", "both"]
            self.cluster.start_one("decode", "--service-id", f"b{i + 1}", *args, label=f"b{i + 1}")
        ports = [free_port() for _ in range(t.routers)]
        for k, port in enumerate(ports):
            label = "router" if k == 0 else f"router_{k + 1}"
            self.cluster.start_one("router", "--port", str(port), *t.router_args, label=label)
        await self.cluster.wait_ready(timeout)
        counts = (("prefill", t.prefill), ("decode", t.decode), ("both", t.both))
        want = {k: n for k, n in counts if n}
        for port in ports:
            await wait_healthy(f"http://127.0.0.1:{port}", want, self.cluster.procs, timeout)
        self.urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
        self.url = self.urls[0]

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None


PEER_KINDS = ("llama.cpp", "llama-server", "transformers")


class PeerServer:
    """Another OpenAI-compatible server on the same model, started from `python`.

    - `llama.cpp`: llama-cpp-python's server on the GGUF file (`python` is a venv where
      `llama_cpp.server` imports; it builds from source). No continuous batching.
    - `transformers`: `transformers serve` with continuous batching on an HF folder holding
      the same weights, dequantized (docs/benchmarks.md shows how to write it); `python`
      needs fastapi and uvicorn besides transformers. It rejects `ignore_eos`, lists no
      local model on /v1/models, and reports no cached tokens.
    - `llama-server`: llama.cpp's own server binary (`make bench-peers` builds it into
      .peers/llama.cpp/bin); `python` is the path of that binary. Continuous batching over
      `parallel` slots sharing a context of `ctx` tokens, no prompt cache.
    `model_name` and `ignore_eos` say how requests must be made.
    """

    def __init__(self, kind: str, python: str, model: Path, workdir: Path, threads: int,
                 *, parallel: int = 1, ctx: int = 4096):  # fmt: skip
        if kind not in PEER_KINDS:
            raise ValueError(f"--peer: expected one of {PEER_KINDS}, got {kind!r}")
        self.kind, self.python, self.model, self.workdir = kind, python, model, workdir
        self.threads, self.parallel, self.ctx = threads, parallel, ctx
        self.proc: subprocess.Popen | None = None
        self.url = ""
        llama = kind in ("llama.cpp", "llama-server")
        self.model_name = "peer" if llama else str(model)
        self.ignore_eos = llama

    def available(self) -> str:
        """ "" when this peer can start here, else why not."""
        if self.kind == "llama-server" and not Path(self.python).is_file():
            return f"no llama-server binary {self.python!r} (make bench-peers)"
        if not self.python or not Path(self.python).exists():
            return f"no interpreter {self.python!r} (--peer-python)"
        if self.kind == "llama-server":
            return "" if self.model.exists() else f"no model at {self.model} (--peer-model)"
        module = "llama_cpp.server" if self.kind == "llama.cpp" else "fastapi, uvicorn"
        probe = subprocess.run([self.python, "-c", f"import {module}"], capture_output=True)
        if probe.returncode != 0:
            return f"{module} does not import in {self.python}"
        if not self.model.exists():
            return f"no model at {self.model} (--peer-model)"
        return ""

    def _launch(self, port: int) -> subprocess.Popen:
        self.workdir.mkdir(parents=True, exist_ok=True)
        where = ["--host", "127.0.0.1", "--port", str(port)]
        if self.kind == "llama-server":
            n = str(self.threads)
            cmd = [self.python, "-m", str(self.model), *where, "-t", n, "-tb", n,
                   "-c", str(self.ctx), "--parallel", str(self.parallel), "--cache-ram", "0",
                   "--alias", "peer"]  # fmt: skip
        elif self.kind == "llama.cpp":
            cmd = [
                self.python,
                "-m",
                "llama_cpp.server",
                "--model",
                str(self.model),
                *where,
                "--n_threads",
                str(self.threads),
                "--n_ctx",
                "4096",
                "--model_alias",
                "peer",
            ]
        else:
            cmd = [
                self.python,
                "-m",
                "transformers.cli.transformers",
                "serve",
                str(self.model),
                *where,
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--continuous-batching",
            ]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1"}
        with open(self.workdir / "peer.log", "ab") as out:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env)  # fmt: skip

    async def start(self, timeout: float = 120.0) -> None:
        port = free_port()
        self.proc = self._launch(port)
        base = f"http://127.0.0.1:{port}/v1"
        probe = "/v1/models" if self.kind == "llama.cpp" else "/health"  # 503 while loading
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"peer exited with {self.proc.returncode} during start")
                try:
                    async with http.get(f"http://127.0.0.1:{port}{probe}") as r:
                        if r.status == 200:
                            self.url = base
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"peer not up within {timeout}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
