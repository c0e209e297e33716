"""Mooncake Store on the same machine, the same cases as bench.pool (optional).

mooncake_master (RPC on a free port, P2PHANDSHAKE metadata: no etcd) + one process
that contributes the segment + a client process that contributes none, zero-copy on a
registered buffer (put_from / get_into / batch_*), TCP transport. Needs the package
`mooncake-transfer-engine-non-cuda` (requirements/bench.txt) and libibverbs1/libnuma1.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from bench.pool_common import CASES, MIB, BenchProcs, row, timed_sync

BATCH = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(master: str, segment: int, local: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, local, "tcp", "", master)
    if code != 0:
        raise RuntimeError(f"mooncake setup failed: {code}")
    return store


def _segment_process(master: str, segment: int) -> None:
    store = _store(master, segment, 16 * MIB)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    store.close()


def _client_process(master: str, seconds: float, max_iters: int, budget: int, conn) -> None:
    try:
        conn.send(("ok", _measure(master, seconds, max_iters, budget)))
    except Exception as e:  # report, do not hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _measure(master: str, seconds: float, max_iters: int, budget: int) -> list[dict[str, Any]]:
    store = _store(master, 0, 16 * MIB)
    buf = mmap.mmap(-1, 2 * BATCH * MIB)
    buf.write(os.urandom(len(buf)))
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if store.register_buffer(base, len(buf)) != 0:
        raise RuntimeError("register_buffer failed")
    dst = base + BATCH * MIB
    rows = []
    for label, size in CASES:
        cap = budget // size
        keys: list[str] = []

        def put_one(i: int, size=size, keys=keys) -> None:
            key = f"s{size}-p-{i}"
            if store.put_from(key, base + (i % BATCH) * size, size) != 0:
                raise RuntimeError(f"put_from {key} failed")
            keys.append(key)

        def get_one(i: int, size=size, keys=keys) -> None:
            if store.get_into(keys[i % len(keys)], dst, size) != size:
                raise RuntimeError("get_into failed")

        def put_batch(i: int, size=size) -> None:
            batch = [f"s{size}-b-{i}-{j}" for j in range(BATCH)]
            ptrs = [base + j * size for j in range(BATCH)]
            if any(r != 0 for r in store.batch_put_from(batch, ptrs, [size] * BATCH)):
                raise RuntimeError("batch_put_from failed")

        def get_batch(i: int, size=size, keys=keys) -> None:
            start = (i * BATCH) % max(1, len(keys) - BATCH)
            batch = keys[start : start + BATCH]
            ptrs = [dst + j * size for j in range(len(batch))]
            if any(r != size for r in store.batch_get_into(batch, ptrs, [size] * len(batch))):
                raise RuntimeError("batch_get_into failed")

        rows.append(row("mooncake", "put", label, size, 1,
                        timed_sync(put_one, seconds, min(max_iters, cap // 2))))  # fmt: skip
        rows.append(row("mooncake", "get", label, size, 1, timed_sync(get_one, seconds, max_iters)))
        lat = timed_sync(put_batch, seconds, max(2, min(max_iters, cap // 2 // BATCH)))
        rows.append(row("mooncake", f"batch_put x{BATCH}", label, size, BATCH, lat))
        if len(keys) >= BATCH:
            lat = timed_sync(get_batch, seconds, max_iters)
            rows.append(row("mooncake", f"batch_get x{BATCH}", label, size, BATCH, lat))
        for key in keys:
            store.remove(key, True)
    probe = [f"exists-{j}" for j in range(BATCH)]
    lat = timed_sync(lambda i: store.is_exist("exists-0"), seconds, max_iters)
    rows.append(row("mooncake", "exists x1", "-", 0, 1, lat))
    lat = timed_sync(lambda i: store.batch_is_exist(probe), seconds, max_iters)
    rows.append(row("mooncake", f"exists x{BATCH}", "-", 0, BATCH, lat))
    store.close()
    return rows


def run_mooncake(args: Any, workdir: Path) -> tuple[str, list[dict[str, Any]]]:
    """('measured', rows), or (why not, [])."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"not installed ({e})", []
    binary = Path(sys.executable).parent / "mooncake_master"
    if not binary.exists():
        found = shutil.which("mooncake_master")
        if found is None:
            return "mooncake_master not found", []
        binary = Path(found)
    port = _free_port()
    procs = BenchProcs(workdir / "mooncake")
    master = f"127.0.0.1:{port}"
    try:
        procs.run([str(binary), f"--rpc_port={port}", f"--metrics_port={_free_port()}",
                   "--enable_metric_reporting=false", "--eviction_high_watermark_ratio=0.95"],
                  "mooncake_master")  # fmt: skip
        time.sleep(1.0)
        segment = 2 * (args.put_budget_mib << 20)  # room for every case, no eviction
        code = (f"import sys; sys.path.insert(0, {str(Path.cwd())!r}); "
                f"from bench.pool_mooncake import _segment_process; "
                f"_segment_process({master!r}, {segment})")  # fmt: skip
        holder = procs.run_stdin([sys.executable, "-c", code], "mooncake_store")
        time.sleep(2.0)
        if holder.poll() is not None:
            return "mooncake store process failed to start", []
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        budget = args.put_budget_mib << 20
        work = (master, args.seconds, args.max_iters, budget, child)
        client = ctx.Process(target=_client_process, args=work)
        client.start()
        if not parent.poll(600):
            client.kill()
            return "mooncake client timed out", []
        status, payload = parent.recv()
        client.join(10)
        return ("measured", payload) if status == "ok" else (f"failed: {payload}", [])
    finally:
        procs.stop()
