"""The whole system as real processes, for fault tests.

    nats-server (JetStream, a port kept across restarts)
    cache_master m1 (--replicas 2)     cache_store s1, s2
    prefill p1, p2                     decode d1, d2
    router (HTTP on a free port)

Every process is started by this object and stopped (or killed) by its own pid. A test
that kills one restarts it before it ends (`restart`), so the next test finds the whole
cluster again; starting it costs seconds of model loading, restarting one worker less.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from libs.common.bus.connection import BusError
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import PoolStats
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.chaos.cases import CASES, references
from tests.chaos.reports import connect
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import wait_healthy

WORKER_ARGS = ("--num-threads", "1", "--kv-cache-mb", "48", "--max-num-batched-tokens", "64",
               "--transport", "tcp", "--handoff-timeout", "60")  # fmt: skip
STORE_ARGS = ("--segment-size", "96MiB", "--transport", "tcp", "--heartbeat-interval", "0.5")
# label -> (service, flags)
TOPOLOGY: dict[str, tuple[str, tuple[str, ...]]] = {
    "m1": ("cache_master", ("--replicas", "2", "--heartbeat-timeout", "10")),
    "s1": ("cache_store", STORE_ARGS),
    "s2": ("cache_store", STORE_ARGS),
    "p1": ("prefill", WORKER_ARGS),
    "p2": ("prefill", WORKER_ARGS),
    "d1": ("decode", WORKER_ARGS),
    "d2": ("decode", WORKER_ARGS),
    # 32 uncached tokens and up go through a prefill worker: most test prompts do
    "router": ("router", ("--port", "0", "--disagg-threshold", "32")),
}
WORKERS = ("p1", "p2", "d1", "d2")


class ChaosCluster:
    """The processes above; `url` is the router's HTTP base once started."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.nats: NatsServer | None = None
        self.local: LocalCluster | None = None
        self.url = ""
        self.want: dict[str, list[str]] = {}  # case name -> greedy reference texts
        self.nats_port = -1
        self._nats_runs = 0

    @property
    def nats_url(self) -> str:
        return self.nats.url

    def start(self, timeout: float = 240.0) -> None:
        """Start everything; meanwhile compute the reference texts of CASES (`want`)."""
        self.start_nats()
        self.local = LocalCluster(self.nats_url, env=router_env(), capture=self.workdir / "logs")
        for label in TOPOLOGY:
            self._spawn(label)

        async def both() -> None:
            self.want = await references(CASES)
            port = await router_port(self.nats_url, "router", timeout)
            self.url = f"http://127.0.0.1:{port}"
            await self.wait_whole(timeout)

        asyncio.run(both())

    async def wait_whole(self, timeout: float = 120.0) -> None:
        """Until every process runs, the router sees 2 + 2 workers and the master 2 stores."""
        for label, alive in self.alive().items():
            if not alive:
                raise RuntimeError(f"{label} is not running; see {self.log_path(label)}")
        await wait_healthy(self.url, {"prefill": 2, "decode": 2}, timeout, self.local.procs)
        bus = await connect(self.nats_url, "chaos-wait")
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        stats = await bus.request("tandem.pool.master.stats", InfoRequest(),
                                                  PoolStats, timeout=2)  # fmt: skip
                        if len(stats.stores) == 2:
                            return
                    except BusError:
                        pass
                    await asyncio.sleep(0.2)
        finally:
            await bus.close()

    def start_nats(self) -> None:
        """(Re)start nats-server on the same port, with an empty JetStream store each time
        (a restart that loses the server's state, the harder case)."""
        self._nats_runs += 1
        workdir = self.workdir / f"nats-{self._nats_runs}"
        self.nats = NatsServer(workdir, port=self.nats_port).start()
        self.nats_port = self.nats.port

    def _spawn(self, label: str) -> None:
        service, flags = TOPOLOGY[label]
        self.local.start_one(service, "--service-id", label, *flags, label=label)

    def pid(self, label: str) -> int:
        return self.local.procs[label].pid

    def kill(self, label: str) -> None:
        """kill -9 one service process (ours, by pid) and reap it."""
        proc = self.local.procs[label]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def kill_nats(self) -> None:
        self.nats.kill()

    def restart(self, label: str) -> None:
        """Start `label` again with its flags (after `kill`)."""
        if self.local.procs[label].poll() is None:
            raise RuntimeError(f"{label} is still running")
        self._spawn(label)

    def alive(self) -> dict[str, bool]:
        return {label: proc.poll() is None for label, proc in self.local.procs.items()}

    def log_path(self, label: str) -> Path:
        return self.workdir / "logs" / f"{label}.log"

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()
        if self.nats is not None:
            self.nats.stop()
