"""A real Tandem stack for the llm_programs tests: a nats-server, `make run`'s workers (one
prefill, one decode: default model, one torch thread each, pool off) and a router."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import WORKER_ARGS, wait_healthy


class Stack:
    """Workers p1 (prefill) and d1 (decode) and router `router-lp`; stopped by their pids."""

    def __init__(self, nats_url: str, logs: Path):
        self.cluster = LocalCluster(nats_url, env=router_env(), capture=logs)
        self.nats_url, self.url = nats_url, ""

    def start(self, timeout: float = 240.0) -> None:
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            self.cluster.start_one(role, "--service-id", sid, *WORKER_ARGS)
            self.cluster.procs[sid] = self.cluster.procs.pop(role)
        self.cluster.start_one("router", "--service-id", "router-lp", "--port", "0")
        port = asyncio.run(router_port(self.nats_url, "router-lp", timeout))
        self.url = f"http://127.0.0.1:{port}"
        want = {"prefill": 1, "decode": 1}
        asyncio.run(wait_healthy(self.url, want, timeout, self.cluster.procs))

    def stop(self) -> None:
        self.cluster.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    nats = NatsServer(tmp_path_factory.mktemp("nats")).start()
    s = Stack(nats.url, tmp_path_factory.mktemp("lp-logs"))
    try:
        s.start()
        yield s
    finally:
        s.stop()
        nats.stop()
