"""The floors under bench.pool's rows, measured in the same run on the same nats-server.

Round trip (request -> nats-server -> responder process -> nats-server -> back), p50:
  - `raw NATS protocol`: blocking sockets speaking the protocol by hand on both sides, no
    asyncio: nats-server plus two process wake-ups each way, the mechanism's floor.
  - `nats-py echo`: stock nats-py request() to a stock nats-py subscription callback.
  - `bus echo`: Bus.request() to a micro endpoint of a Bus (the path the master serves
    on), with pool messages: what an `exists` costs without the master's work.
Bytes (this process): the transfer engine's read and write of one object from/to a
store's segment and its xxh3 checksum; with the round trips they bound a single get
(one round trip + read + checksum) and put (two round trips + checksum + write).

The responders run as `python -m bench.pool_floor --serve raw|nats-py|bus NATS_URL`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
from typing import Any
from urllib.parse import urlparse

import structlog

from bench.pool_common import CASES, BenchProcs, row, timed, timed_sync
from libs.common import event_loop
from libs.common.bus.connection import Bus, Endpoint
from libs.common.messages.pool import (
    PoolCount,
    PoolGetReply,
    PoolKeys,
    PoolNewObject,
    PoolPutFinish,
    PoolPutStart,
    PoolPutStartReply,
)
from libs.common.pool.client import LocalMemory, PoolClient, checksum
from libs.common.transfer import RegionDescriptor
from scripts.cluster import REPO

SUBJECT = "bench.pool.echo"
PAYLOAD = PoolKeys(["0" * 32]).encode()  # an exists of one key, as the client sends it


def _raw_connect(url: str) -> tuple[socket.socket, Any]:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = sock.makefile("rb")
    reader.readline()  # INFO
    return sock, reader


def _raw_sub(sock: socket.socket, reader: Any, subject: str) -> None:
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nSUB %s 1\r\nPING\r\n'
                 % subject.encode())  # fmt: skip
    while reader.readline().strip() != b"PONG":
        pass


def _raw_next(sock: socket.socket, reader: Any) -> tuple[bytes, bytes] | None:
    """The next MSG as (reply subject, payload); answers the server's PINGs."""
    while True:
        line = reader.readline()
        if not line:
            return None
        if line.startswith(b"PING"):
            sock.sendall(b"PONG\r\n")
        elif line.startswith(b"MSG"):
            parts = line.split()
            data = reader.read(int(parts[-1]) + 2)[:-2]
            return (parts[3] if len(parts) == 5 else b""), data


def _serve_raw(url: str) -> None:
    sock, reader = _raw_connect(url)
    _raw_sub(sock, reader, SUBJECT)
    print("ready", flush=True)
    while (msg := _raw_next(sock, reader)) is not None:
        reply, _ = msg
        body = PoolCount(1).encode()
        sock.sendall(b"PUB %s %d\r\n%s\r\n" % (reply, len(body), body))


async def _serve_async(url: str, mode: str) -> None:
    if mode == "nats-py":
        from nats.aio.client import Client

        nc = Client()
        await nc.connect(url)

        async def echo(msg: Any) -> None:
            PoolKeys.decode(msg.data)
            await msg.respond(PoolCount(1).encode())

        await nc.subscribe(SUBJECT, cb=echo)
        await nc.flush()
    else:
        bus = Bus(url, "bench-pool-echo", connect_timeout=10, request_timeout=10)
        await bus.connect()

        async def count(req: PoolKeys) -> PoolCount:
            return PoolCount(len(req.keys))

        echo = Endpoint("echo", SUBJECT, PoolKeys, count)
        await bus.add_service("bench-pool-echo", "0.0.1", "bench.pool round-trip floor", [echo])
    print("ready", flush=True)
    await asyncio.sleep(3600)  # stopped by the benchmark (SIGTERM)


def _start(procs: BenchProcs, url: str, mode: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bench.pool_floor", "--serve", mode, url]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    procs.procs.append(proc)
    if proc.stdout is None or proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"bench.pool_floor --serve {mode} did not start")
    return proc


def _raw_rtt(url: str, seconds: float, max_iters: int) -> list[float]:
    sock, reader = _raw_connect(url)
    try:
        _raw_sub(sock, reader, "_bench_inbox.*")

        def once(i: int) -> None:
            sock.sendall(b"PUB %s _bench_inbox.%d %d\r\n%s\r\n"
                         % (SUBJECT.encode(), i, len(PAYLOAD), PAYLOAD))  # fmt: skip
            _raw_next(sock, reader)

        return timed_sync(once, seconds, max_iters)
    finally:
        sock.close()


async def round_trips(url: str, bus: Bus, procs: BenchProcs, args: Any) -> list[dict[str, Any]]:
    """The three round-trip rows (module docstring), each against its own responder."""
    from nats.aio.client import Client

    rows = []
    for mode in ("raw", "nats-py", "bus"):
        proc = _start(procs, url, mode)
        try:
            if mode == "raw":
                lat = _raw_rtt(url, args.seconds, args.max_iters)
                rows.append(row("floor", "raw NATS protocol", "-", 0, 1, lat))
                continue
            if mode == "bus":
                req = PoolKeys(["0" * 32])
                lat = await timed(lambda i, r=req: bus.request(SUBJECT, r, PoolCount),
                                  args.seconds, args.max_iters)  # fmt: skip
                rows.append(row("floor", "bus echo", "-", 0, 1, lat))
                continue
            nc = Client()
            await nc.connect(url)
            try:
                lat = await timed(lambda i, c=nc: c.request(SUBJECT, PAYLOAD, timeout=10),
                                  args.seconds, args.max_iters)  # fmt: skip
                rows.append(row("floor", "nats-py echo", "-", 0, 1, lat))
            finally:
                await nc.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return rows


async def bytes_floor(client: PoolClient, mem: LocalMemory, label: str, size: int,
                      args: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Transfer write of one `size` object at the place put_start gave (its write grant),
    read of it through a get's read grant (then removed), and its xxh3; measured back to
    back like a row."""
    data = mem.view[:size]
    start = PoolPutStart([PoolNewObject(f"floor-{size}", size, checksum(data))], 1)
    reply = await client._ask("put_start", start, PoolPutStartReply)
    (slot,) = reply.slots
    if slot.status != "ok":
        raise RuntimeError(f"bytes floor: put_start answered {slot.status}")
    ((store, offset),) = [(r.store, r.offset) for r in slot.replicas]
    remote = RegionDescriptor.from_dict(reply.segments[store])
    engine, dst = client.engine, mem.view.nbytes // 2
    keys = [o.key for o in start.objects]
    try:
        write = await timed(lambda i: engine.write(mem.region, remote, [(0, offset, size)]),
                            args.seconds / 2, args.max_iters)  # fmt: skip
        await client._ask("put_end", PoolPutFinish(reply.put_id, keys), PoolKeys)
        got = await client._ask("get", PoolKeys(keys), PoolGetReply)
        readable = RegionDescriptor.from_dict(got.segments[store])
        read = await timed(lambda i: engine.read(mem.region, readable, [(dst, offset, size)]),
                           args.seconds / 2, args.max_iters)  # fmt: skip
    finally:
        await client._ask("put_revoke", PoolPutFinish(reply.put_id, keys), PoolCount)
        await client.remove(keys)
    sums = timed_sync(lambda i: checksum(data), args.seconds / 4, args.max_iters)
    return [row("floor", "transfer write", label, size, 1, write),
            row("floor", "transfer read", label, size, 1, read),
            row("floor", "xxh3", label, size, 1, sums)]  # fmt: skip


def bounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Single get / put at their floors: p50s of the parts, added (no overlap)."""
    by = {(r["system"], r["op"], r["case"]): r for r in rows}
    rtt = by.get(("floor", "bus echo", "-"))
    out = []
    for (system, op, case), r in by.items():
        if system != "floor" or op != "xxh3" or rtt is None:
            continue
        parts = {
            "get": (rtt["p50_us"], by[("floor", "transfer read", case)]["p50_us"]),
            "put": (2 * rtt["p50_us"], by[("floor", "transfer write", case)]["p50_us"]),
        }
        for kind, (trips, moved) in parts.items():
            us = trips + moved + r["p50_us"]
            size = dict(CASES)[case]
            out.append({"system": "floor", "op": f"{kind} bound", "case": case, "calls": 0,
                        "ops_per_s": round(1e6 / us, 1), "gbps": round(size / us / 1e3, 3),
                        "p50_us": round(us, 1), "p99_us": 0.0})  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool_floor", description=__doc__)
    parser.add_argument("--serve", choices=("raw", "nats-py", "bus"), required=True)
    parser.add_argument("url")
    args = parser.parse_args()
    # stdout tells the benchmark "ready"; logs go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.serve == "raw":
        _serve_raw(args.url)
    else:
        event_loop.run(_serve_async(args.url, args.serve))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
