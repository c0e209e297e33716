"""A real pool for tests: nats-server, one cache_master and N cache_stores as subprocesses,
and an in-process client (Bus + tcp transfer engine + PoolClient)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libs.common.bus.connection import Bus, BusError
from libs.common.messages.control import InfoRequest, ServiceInfo
from libs.common.pool.client import LocalMemory, PoolClient
from libs.common.transfer import create_engine
from scripts.cluster import REPO


class PoolProcesses:
    """The master and stores this test started, by service id; stopped by their pids."""

    def __init__(self, nats_url: str, env: dict[str, str], logs: Path):
        self.nats_url, self.env, self.logs = nats_url, env, logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, service: str, sid: str, *args: str) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", f"services.{service}", "--nats-url", self.nats_url,
               "--service-id", sid, *args]  # fmt: skip
        with open(self.logs / f"{sid}.log", "ab") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        self.procs[sid] = proc
        return proc

    def master(self, *args: str) -> subprocess.Popen:
        return self.start("cache_master", "master", "--heartbeat-timeout", "3", *args)

    def store(self, sid: str, *args: str, size: str = "8MiB") -> subprocess.Popen:
        return self.start("cache_store", sid, "--segment-size", size, "--transport", "tcp",
                          "--heartbeat-interval", "0.3", *args)  # fmt: skip

    def kill(self, sid: str) -> None:
        proc = self.procs.pop(sid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self, sid: str) -> int:
        proc = self.procs.pop(sid)
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop_all(self) -> None:
        """SIGTERM to the stores at once (they unmount), then to the master."""
        procs, self.procs = self.procs, {}
        master = procs.pop("master", None)
        for group in (list(procs.values()), [master] if master else []):
            for proc in group:
                proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def log(self, sid: str) -> str:
        return (self.logs / f"{sid}.log").read_text(errors="replace")


class PoolHarness:
    """A client with a 16 MiB registered buffer: `src` to put from, `dst` to get into."""

    def __init__(self, procs: PoolProcesses, bus: Bus, engine, client: PoolClient):
        self.procs, self.bus, self.engine, self.client = procs, bus, engine, client
        self.buffer = engine.allocate(16 << 20)
        self.mem = LocalMemory.register(engine, self.buffer)
        self.half = 8 << 20  # [0, half): sources, [half, end): destinations

    def fill(self, offset: int, data: bytes) -> None:
        self.buffer[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self.buffer[offset : offset + size])

    async def wait_stores(self, count: int, timeout: float = 30.0) -> None:
        """Until the master has exactly `count` stores mounted (bounded in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for sid, proc in self.procs.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{sid} exited {proc.returncode}: {self.procs.log(sid)}")
            try:
                stats = await self.client.stats()
                if len(stats.stores) == count:
                    return
            except Exception:
                pass  # master not up yet
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{count} stores not mounted within {timeout}s")

    async def wait_objects(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if (await self.client.stats()).objects >= count:
                    return
            except Exception:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{count} objects not back within {timeout}s")


@pytest.fixture
def pool_procs(nats_url, service_env, tmp_path):
    procs = PoolProcesses(nats_url, service_env, tmp_path / "logs")
    try:
        yield procs
    finally:
        procs.stop_all()


@contextlib.asynccontextmanager
async def master_and_client(pool_procs, nats_url, *master_args, name="pool-test-client"):
    """A master started with `master_args` and an in-process client on it."""
    pool_procs.master(*master_args)
    bus = Bus(nats_url, name, connect_timeout=10, request_timeout=5)
    engine = create_engine("tcp", host="127.0.0.1")
    await bus.connect()
    await engine.start()
    try:
        yield PoolHarness(pool_procs, bus, engine, PoolClient(bus, engine, timeout=10))
    finally:
        await engine.stop()
        await bus.close()


@pytest.fixture
async def pool(pool_procs, nats_url):
    """Master + client; the test starts its stores (pool.procs.store(...)) and waits."""
    async with master_and_client(pool_procs, nats_url) as harness:
        yield harness


def corrupt_segment_file(path, offset: int, data: bytes) -> None:
    """Overwrite bytes of a store's --segment-file under the running store (its shared
    mapping sees them): stored bytes gone bad at rest. Peers cannot do this through the
    transfer engine any more: a get's grant is read-only (docs/pool.md, "Capabilities")."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


async def master_role(bus, sid: str) -> str:
    """Master `sid`'s role from its `info` (leader, standby, fenced), or "down"."""
    try:
        reply = await bus.request(f"tandem.cache_master.{sid}.info", InfoRequest(), ServiceInfo,
                                  timeout=1, responder_wait=0.2)  # fmt: skip
    except BusError:
        return "down"
    return reply.details["role"]
