"""What bench.pool and bench.pool_mooncake share: cases, timing, rows, child processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from scripts.cluster import REPO

KIB, MIB = 1 << 10, 1 << 20
CASES = (("4 KiB", 4 * KIB), ("1 MiB", MIB))


async def timed(call: Callable[[int], Awaitable[Any]], seconds: float, max_iters: int) -> list:
    """Call `call(i)` back to back for `seconds` (at most `max_iters`); return latencies."""
    lat: list[float] = []
    end = time.perf_counter() + seconds
    for i in range(max(1, max_iters)):
        t0 = time.perf_counter()
        await call(i)
        lat.append(time.perf_counter() - t0)
        if t0 > end:
            break
    return lat


def timed_sync(call: Callable[[int], Any], seconds: float, max_iters: int) -> list:
    lat: list[float] = []
    end = time.perf_counter() + seconds
    for i in range(max(1, max_iters)):
        t0 = time.perf_counter()
        call(i)
        lat.append(time.perf_counter() - t0)
        if t0 > end:
            break
    return lat


def row(system: str, op: str, case: str, size: int, per_call: int, lat: list) -> dict[str, Any]:
    lat = sorted(lat)
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    total = sum(lat)
    return {
        "system": system, "op": op, "case": case, "calls": len(lat),
        "ops_per_s": round(per_call * len(lat) / total, 1),
        "gbps": round(size * per_call * len(lat) / total / 1e9, 3),
        "p50_us": round(pick(0.5) * 1e6, 1), "p99_us": round(pick(0.99) * 1e6, 1),
    }  # fmt: skip


class BenchProcs:
    """Child processes of the benchmark, stopped by their pids (SIGTERM, then SIGKILL)."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(self, service: str, *args: str) -> subprocess.Popen:
        return self.run([sys.executable, "-m", f"services.{service}", *args], service)

    def run(self, cmd: list[str], name: str) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}-{len(self.procs)}.log", "ab") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
        self.procs.append(proc)
        return proc

    def run_stdin(self, cmd: list[str], name: str) -> subprocess.Popen:
        """Like run, with a stdin pipe: the child may wait for it to close."""
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}-{len(self.procs)}.log", "ab") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        procs, self.procs = self.procs, []
        for proc in reversed(procs):
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
