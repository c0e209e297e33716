"""KV pool benchmark: a real nats-server, cache_master and two cache_stores on loopback.

    python -m bench.pool --json                 # Tandem (tcp) and Mooncake Store, JSON
    python -m bench.pool --transport shm        # same host, shared-memory transport
    python -m bench.pool --no-mooncake --seconds 1

For 4 KiB and 1 MiB objects: put (one object per call), get (one per call), batch_put
and batch_get of 64 objects per call, each timed back to back for `--seconds` (at most
`--max-iters` calls), as ops/s, GB/s and p50/p99 call latency; and exists latency (one
NATS round trip for 1 or 64 keys). Every put writes a new key (no overwrites); gets read
what the puts stored. The stores and the master run as separate processes, the client
in this one, like a worker in a deployment. Mooncake Store (mooncake_master plus a store
process contributing the segment, this process a client; zero-copy put_from/get_into on
a registered buffer, TCP transport) runs when the package imports (bench/pool_mooncake.py).
Rows of system `floor` (bench/pool_floor.py) measure, in the same run, what the calls are
built on: a NATS round trip three ways (raw protocol, stock nats-py, the Bus), the
transfer engine's read/write of one object and its xxh3, and from those the floor of a
single get and put, and the master -> store grant round trip that capabilities add to
get, put_start and put_end (bench/pool_grants.py); `--no-floor` skips them. Rows of
system `mac` and `tandem-*+mac` (bench/pool_integrity.py, first, on an empty pool)
measure the keyed MAC tags: hashing GB/s, and put/get of one object with integrity off
and on, alternating;
`--no-integrity` skips them, `--only-integrity` runs nothing else (no Mooncake).
Load averages are recorded: on a shared machine compare ratios from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import structlog

from bench.pool_common import CASES, BenchProcs, row, timed
from bench.pool_floor import bounds, bytes_floor, round_trips
from bench.pool_grants import grant_rows
from bench.pool_integrity import integrity_rows, overheads
from libs.common import event_loop
from libs.common.bus.connection import Bus
from libs.common.pool.client import LocalMemory, PoolClient
from libs.common.transfer import create_engine
from scripts.nats_server import NatsServer

BATCH = 64


async def run_tandem(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    nats_server = NatsServer(workdir / "nats").start()
    procs = BenchProcs(workdir / "logs")
    transport = args.transport
    try:
        procs.start("cache_master", "--nats-url", nats_server.url, "--service-id", "master",
                    "--replicas", "1", "--log-level", "warning")  # fmt: skip
        for sid in ("store-a", "store-b"):
            procs.start("cache_store", "--nats-url", nats_server.url, "--service-id", sid,
                        "--transport", transport, "--segment-size", args.segment_size,
                        "--log-level", "warning")  # fmt: skip
        bus = Bus(nats_server.url, "bench-pool", connect_timeout=10, request_timeout=10)
        engine = create_engine(transport, **({"host": "127.0.0.1"} if transport == "tcp" else {}))
        await bus.connect()
        await engine.start()
        try:
            client = PoolClient(bus, engine, timeout=30)
            await _wait_stores(client, 2)
            rows = [] if args.no_integrity else await integrity_rows(client, engine, args)
            if args.only_integrity:
                return rows
            rows += await _measure(client, engine, transport, args)
            if not args.no_floor:
                rows += await grant_rows(client, bus, "store-a", args)
                rows += await round_trips(nats_server.url, bus, procs, args)
                rows += bounds(rows)
            return rows
        finally:
            await engine.stop()
            await bus.close()
    finally:
        procs.stop()
        nats_server.stop()


async def _wait_stores(client: PoolClient, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len((await client.stats()).stores) >= count:
                return
        except Exception:
            pass  # the master is starting
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{count} stores not mounted within {timeout}s")


async def _measure(client, engine, transport: str, args) -> list[dict[str, Any]]:
    name = f"tandem-{transport}"
    buf = engine.allocate(2 * BATCH << 20)
    buf[:] = os.urandom(len(buf))
    mem = LocalMemory.register(engine, buf)
    rows = []
    for label, size in CASES:
        rows += await _case(client, mem, name, label, size, args)
        if not args.no_floor:
            rows += await bytes_floor(client, mem, label, size, args)
    for n in (1, BATCH):
        probe = [f"exists-{j}" for j in range(n)]
        lat = await timed(lambda i, p=probe: client.batch_exists(p), args.seconds, args.max_iters)
        rows.append(row(name, f"exists x{n}", "-", 0, n, lat))
    return rows


async def _case(client, mem, name: str, label: str, size: int, args) -> list[dict[str, Any]]:
    """put, get, batch_put, batch_get of one object size; removes what it stored."""
    budget = (args.put_budget_mib << 20) // size  # objects the segments hold, no eviction
    dst = BATCH << 20  # destinations in the second half of the buffer
    keys: list[str] = []

    async def put_one(i: int) -> None:
        key = f"s{size}-p-{i}"
        (result,) = await client.batch_put([key], mem, [(i % BATCH) * size], [size])
        if not result.ok:
            raise RuntimeError(f"put {key}: {result.error}")
        keys.append(key)

    async def get_one(i: int) -> None:
        (result,) = await client.batch_get([keys[i % len(keys)]], mem, [dst], size)
        if not result.ok:
            raise RuntimeError(f"get: {result.error}")

    async def put_batch(i: int) -> None:
        batch = [f"s{size}-b-{i}-{j}" for j in range(BATCH)]
        results = await client.batch_put(batch, mem, [j * size for j in range(BATCH)],
                                         [size] * BATCH)  # fmt: skip
        if not all(r.ok for r in results):
            raise RuntimeError(f"batch_put: {[r.error for r in results if not r.ok][:3]}")

    async def get_batch(i: int) -> None:
        start = (i * BATCH) % max(1, len(keys) - BATCH)
        batch = keys[start : start + BATCH]
        results = await client.batch_get(batch, mem, [dst + j * size for j in range(len(batch))],
                                         size)  # fmt: skip
        if not all(r.ok for r in results):
            raise RuntimeError("batch_get: miss")

    rows = []
    lat = await timed(put_one, args.seconds, min(args.max_iters, budget // 2))
    rows.append(row(name, "put", label, size, 1, lat))
    lat = await timed(get_one, args.seconds, args.max_iters)
    rows.append(row(name, "get", label, size, 1, lat))
    batches = max(2, min(args.max_iters, budget // 2 // BATCH))
    rows.append(row(name, f"batch_put x{BATCH}", label, size, BATCH,
                    await timed(put_batch, args.seconds, batches)))  # fmt: skip
    if len(keys) >= BATCH:
        lat = await timed(get_batch, args.seconds, args.max_iters)
        rows.append(row(name, f"batch_get x{BATCH}", label, size, BATCH, lat))
    await client.remove(keys)  # room for the next case
    return rows


def ratios(rows: list[dict[str, Any]], ours: str) -> list[str]:
    """Tandem / Mooncake for the same op and size, measured in this run."""
    by = {(r["system"], r["op"], r["case"]): r for r in rows}
    out = []
    for (system, op, case), r in sorted(by.items()):
        bound = system == "floor" and op.endswith(" bound")
        theirs = by.get(("mooncake", op.removesuffix(" bound"), case))
        if not (system == ours or bound) or theirs is None:
            continue
        if r["gbps"] and theirs["gbps"]:
            what = f"{op} {case}" + (" (floor: round trips + bytes + xxh3)" if bound else "")
            out.append(f"{what}: {r['gbps'] / theirs['gbps']:.2f}x Mooncake GB/s")
        elif r["p50_us"] and theirs["p50_us"]:
            out.append(f"{op}: p50 {r['p50_us']:.0f} us vs Mooncake {theirs['p50_us']:.0f} us")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    parser.add_argument("--seconds", type=float, default=2.0, help="time per case")
    parser.add_argument("--max-iters", type=int, default=3000, help="calls per case, at most")
    parser.add_argument("--segment-size", default="768MiB", help="each store's segment")
    parser.add_argument("--put-budget-mib", type=int, default=1024,
                        help="MiB a case may put (keep under the stores' total)")  # fmt: skip
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake even if present")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the floor rows (bench/pool_floor.py)")  # fmt: skip
    parser.add_argument("--no-integrity", action="store_true",
                        help="skip the MAC rows (bench/pool_integrity.py)")  # fmt: skip
    parser.add_argument("--only-integrity", action="store_true",
                        help="only the MAC rows (and no Mooncake)")  # fmt: skip
    args = parser.parse_args(argv)
    # stdout carries the table / JSON; logs go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.seconds <= 0 or args.max_iters < 5:
        parser.error("--seconds must be positive and --max-iters at least 5")
    meta: dict[str, Any] = {
        "load_before": os.getloadavg(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "started": time.time(),
    }
    with tempfile.TemporaryDirectory(prefix="tandem-bench-pool-") as tmp:
        rows = event_loop.run(run_tandem(args, Path(tmp)))
        meta["load_mid"] = os.getloadavg()
        mooncake = "skipped (--no-mooncake)"
        if not args.no_mooncake and not args.only_integrity:
            from bench.pool_mooncake import run_mooncake

            mooncake, more = run_mooncake(args, Path(tmp))
            rows += more
    meta.update(load_after=os.getloadavg(), mooncake=mooncake,
                ratios=ratios(rows, f"tandem-{args.transport}"),
                integrity=overheads(rows), host=platform.node(),
                cpu=platform.processor() or platform.machine())  # fmt: skip
    if args.json:
        sys.stdout.write(orjson.dumps({"meta": meta, "rows": rows}, option=orjson.OPT_INDENT_2)
                         .decode() + "\n")  # fmt: skip
    else:
        for r in rows:
            print(f"{r['system']:14} {r['op']:14} {r['case']:7} {r['ops_per_s']:>10.0f} ops/s "
                  f"{r['gbps']:>7.3f} GB/s  p50 {r['p50_us']:>8.0f} us  "
                  f"p99 {r['p99_us']:>8.0f} us")  # fmt: skip
        print("\n" + "\n".join(meta["ratios"] + meta["integrity"]))
        print(f"\nload average before {meta['load_before']}, after {meta['load_after']}; "
              f"mooncake: {mooncake}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
