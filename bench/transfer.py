"""Transfer-engine benchmark on loopback: tcp and shm next to memcpy (and Mooncake).

    python -m bench.transfer --json            # every transport, JSON on stdout
    python -m bench.transfer --transports tcp --seconds 0.5
    python -m bench.transfer --transports tcp --ops write --handoff   # + handoff MAC cost

For each case (one op of 4 KiB, 64 KiB, 1 MiB, 16 MiB; one batch of 64 x 1 MiB) it
times whole batches, back to back, for `--seconds` (at most `--max-iters`), and
reports GB/s (bytes moved / time spent in batches) and p50/p99 batch latency. The
peer lives in a separate process, like in a deployment. memcpy is numpy.copyto of
the same sizes in this process; Mooncake (mooncake-transfer-engine-non-cuda, TCP
transport, P2PHANDSHAKE metadata, no etcd) runs when the package imports. The floors
of bare Python sockets (bench/transfer_floors.py: a 4 KiB ping-pong, a 1 MiB stream)
are measured in the same run, so the table shows whether a tcp goal is reachable. Load
averages are recorded because the machine may be shared: compare ratios measured in
one run rather than absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import structlog

from libs.common import event_loop
from libs.common.transfer import RegionDescriptor, create_engine

from .transfer_floors import run_floors
from .transfer_handoff import run_handoff
from .transfer_report import ratios, table

KIB, MIB = 1 << 10, 1 << 20
TCP_DEFAULT_CONNECTIONS = 3  # TcpTransferEngine's connections_per_peer default
SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB)
BATCH = (64, MIB)
REGION_BYTES = 64 * MIB


def _cases() -> list[tuple[str, list[tuple[int, int, int]]]]:
    cases = [(f"1 x {_human(s)}", [(0, 0, s)]) for s in SIZES]
    count, size = BATCH
    cases.append((f"{count} x {_human(size)}", [(i * size, i * size, size) for i in range(count)]))
    return cases


def _human(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def _stats(name: str, op: str, case: str, nbytes: int, lat: list[float]) -> dict[str, Any]:
    lat = sorted(lat)
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {
        "transport": name, "op": op, "case": case, "bytes": nbytes, "iters": len(lat),
        "gbps": round(nbytes * len(lat) / sum(lat) / 1e9, 3),
        "p50_us": round(pick(0.50) * 1e6, 1), "p99_us": round(pick(0.99) * 1e6, 1),
    }  # fmt: skip


async def _time_async(fn: Callable[[], Awaitable[Any]], seconds: float, max_iters: int) -> list:
    for _ in range(3):  # warm up: connections, page faults
        await fn()
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while len(lat) < max_iters and (time.perf_counter() < end or len(lat) < 5):
        t0 = time.perf_counter()
        await fn()
        lat.append(time.perf_counter() - t0)
    return lat


def _time_sync(fn: Callable[[], Any], seconds: float, max_iters: int) -> list[float]:
    async def wrapped() -> None:
        fn()

    return event_loop.run(_time_async(wrapped, seconds, max_iters))


# -- peers in child processes ------------------------------------------------------------


def _logs_to_stderr() -> None:
    # stdout carries the table / JSON; engine logs go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def _tandem_peer(transport: str, options: dict[str, Any], conn: Any) -> None:
    _logs_to_stderr()

    async def serve() -> None:
        engine = create_engine(transport, **options)
        async with engine:
            region = engine.allocate(REGION_BYTES)
            conn.send(engine.register(region).to_dict())
            await asyncio.to_thread(conn.recv)

    event_loop.run(serve())


def _mooncake_peer(conn: Any) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buffer = engine.allocate_managed_buffer(REGION_BYTES)
    conn.send((engine.get_rpc_port(), buffer))
    conn.recv()


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise RuntimeError(f"{target.__name__}: peer did not start within 60 s")
    return proc, parent, parent.recv()


def _stop(proc: Any, parent: Any) -> None:
    parent.send("stop")
    proc.join(10)
    if proc.is_alive():
        proc.kill()


# -- runs ---------------------------------------------------------------------------------


def run_tandem(
    transport: str, options: dict[str, Any], ops_kinds: list[str], seconds: float, max_iters: int,
    handoff: bool = False,
) -> list:  # fmt: skip
    proc, parent, remote_dict = _spawn(_tandem_peer, transport, options)
    remote = RegionDescriptor.from_dict(remote_dict)
    rows: list[dict[str, Any]] = []

    async def measure() -> None:
        engine = create_engine(transport, **options)
        async with engine:
            local_mem = engine.allocate(REGION_BYTES)
            local_mem[:] = os.urandom(MIB) * (REGION_BYTES // MIB)
            local = engine.register(local_mem)
            for kind in ops_kinds:
                call = engine.write if kind == "write" else engine.read
                for case, ops in _cases():

                    def once(o: list = ops, fn: Callable = call) -> Awaitable[None]:
                        return fn(local, remote, o)

                    lat = await _time_async(once, seconds, max_iters)
                    rows.append(_stats(transport, kind, case, sum(o[2] for o in ops), lat))
            if handoff:
                rows.extend(await run_handoff(engine, local, remote, local_mem,
                                              transport=transport, seconds=seconds,
                                              max_iters=max_iters, stats=_stats))  # fmt: skip

    try:
        event_loop.run(measure())
    finally:
        _stop(proc, parent)
    return rows


def run_memcpy(seconds: float, max_iters: int) -> list[dict[str, Any]]:
    src = np.frombuffer(os.urandom(MIB) * (REGION_BYTES // MIB), dtype=np.uint8).copy()
    dst = np.zeros(REGION_BYTES, dtype=np.uint8)
    rows = []
    for case, ops in _cases():
        pieces = [(dst[r : r + n], src[lo : lo + n]) for lo, r, n in ops]

        def copy(pieces: list = pieces) -> None:
            for d, s in pieces:
                np.copyto(d, s)

        lat = _time_sync(copy, seconds, max_iters)
        rows.append(_stats("memcpy", "copy", case, sum(o[2] for o in ops), lat))
    return rows


def run_mooncake(ops_kinds: list[str], seconds: float, max_iters: int) -> list[dict[str, Any]]:
    from mooncake.engine import TransferEngine

    proc, parent, (port, remote_base) = _spawn(_mooncake_peer)
    rows = []
    try:
        engine = TransferEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake: initialize failed")
        base = engine.allocate_managed_buffer(REGION_BYTES)
        target = f"127.0.0.1:{port}"
        for kind in ops_kinds:
            write = kind == "write"
            batch = engine.batch_transfer_sync_write if write else engine.batch_transfer_sync_read
            single = engine.transfer_sync_write if write else engine.transfer_sync_read
            for case, ops in _cases():
                local = [base + lo for lo, _, _ in ops]
                remote = [remote_base + r for _, r, _ in ops]
                lengths = [n for _, _, n in ops]

                def once(a=local, b=remote, c=lengths, one=single, many=batch) -> None:
                    # Its fastest path each time: the single-op call for one op.
                    rc = one(target, a[0], b[0], c[0]) if len(c) == 1 else many(target, a, b, c)
                    if rc != 0:
                        raise RuntimeError("mooncake: transfer failed")

                lat = _time_sync(once, seconds, max_iters)
                rows.append(_stats("mooncake-tcp", kind, case, sum(lengths), lat))
    finally:
        _stop(proc, parent)
    return rows


def _mooncake_available() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc})"
    return None


def _options(pairs: list[str]) -> dict[str, Any]:
    """--tcp-opt KEY=VALUE pairs -> engine keywords (ints, floats, else strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--tcp-opt: expected KEY=VALUE, got {pair!r}")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--transports", default="tcp,shm", help="comma list of tcp, shm")
    parser.add_argument("--ops", default="write,read", help="comma list of write, read")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per case")
    parser.add_argument("--max-iters", type=int, default=5000, help="iterations cap per case")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake even if present")
    parser.add_argument("--no-floors", action="store_true", help="skip the bare-socket floors")
    parser.add_argument("--handoff", action="store_true",
                        help="also time KV handoffs with and without their MAC check "
                        "(bench/transfer_handoff.py)")  # fmt: skip
    parser.add_argument("--tcp-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="TcpTransferEngine keyword for both ends, e.g. "
                        "connections_per_peer=4 (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    _logs_to_stderr()
    if args.seconds <= 0 or args.max_iters < 5:
        parser.error("--seconds must be positive and --max-iters at least 5")
    try:
        tcp_options = _options(args.tcp_opt)
    except ValueError as exc:
        parser.error(str(exc))
    kinds = [k for k in args.ops.split(",") if k]
    transports = [t for t in args.transports.split(",") if t]
    if not transports or set(transports) - {"tcp", "shm"}:
        parser.error(f"--transports: a comma list of tcp and shm, got {args.transports!r}")
    if not kinds or set(kinds) - {"write", "read"}:
        parser.error(f"--ops: a comma list of write and read, got {args.ops!r}")
    meta: dict[str, Any] = {
        "load_before": os.getloadavg(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "started": time.time(),
        "tcp_options": tcp_options,
    }
    rows = run_memcpy(args.seconds, args.max_iters)
    if "tcp" in transports and not args.no_floors:
        conns = tcp_options.get("connections_per_peer", TCP_DEFAULT_CONNECTIONS)
        rows += run_floors(args.seconds, args.max_iters, conns, _stats)
    for transport in transports:
        options = tcp_options if transport == "tcp" else {}
        rows += run_tandem(transport, options, kinds, args.seconds, args.max_iters, args.handoff)
    missing = "skipped (--no-mooncake)" if args.no_mooncake else _mooncake_available()
    if missing is None:
        rows += run_mooncake(kinds, args.seconds, args.max_iters)
    meta.update(load_after=os.getloadavg(), mooncake=missing or "measured", ratios=ratios(rows))
    if args.json:
        sys.stdout.write(orjson.dumps({"meta": meta, "rows": rows}, option=orjson.OPT_INDENT_2)
                         .decode() + "\n")  # fmt: skip
    else:
        print(table(rows))
        print("\n" + "\n".join(ratios(rows)))
        print(f"\nload average before {meta['load_before']}, after {meta['load_after']}; "
              f"mooncake: {meta['mooncake']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
