"""A disaggregated cluster of real processes for the migration tests: nats-server, one
prefill worker (p1), two decode workers (d1, d2) and a router whose prompts above 16
uncached tokens go through p1. Started and stopped by their own pids."""

from __future__ import annotations

import asyncio
import os
import signal

from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import WORKER_ARGS, wait_healthy

WORKERS = ("p1", "d1", "d2")


class PdCluster:
    """`worker_args`: each worker's flags by service id (default: WORKER_ARGS for all)."""

    def __init__(self, workdir, router: str, worker_args: dict[str, tuple[str, ...]] | None = None):
        self.nats = NatsServer(workdir / "nats").start()
        self.local = LocalCluster(self.nats.url, env=router_env(), capture=workdir / "logs")
        self.router, self.url = router, ""
        self.worker_args = worker_args or {sid: WORKER_ARGS for sid in WORKERS}

    def start(self) -> PdCluster:
        for sid in self.worker_args:
            self.spawn(sid)
        self.local.start_one("router", "--service-id", self.router, "--port", "0",
                             "--disagg-threshold", "16", label="router")  # fmt: skip
        port = asyncio.run(router_port(self.nats.url, self.router, 240))
        self.url = f"http://127.0.0.1:{port}"
        asyncio.run(self.whole())
        return self

    def spawn(self, sid: str) -> None:
        """Start worker `sid` (again, after `kill`) with its flags."""
        role = "prefill" if sid.startswith("p") else "decode"
        self.local.start_one(role, "--service-id", sid, *self.worker_args[sid], label=sid)

    async def whole(self) -> None:
        await wait_healthy(self.url, {"prefill": 1, "decode": 2}, 240, self.local.procs)

    def kill(self, sid: str) -> None:
        """kill -9 one worker (ours, by pid) and reap it."""
        proc = self.local.procs[sid]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        self.local.stop()
        self.nats.stop()
