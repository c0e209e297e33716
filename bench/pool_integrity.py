"""What the pool's keyed MAC tags cost (libs/common/pool/integrity.py), in bench.pool's run.

Rows of system `mac`: one core hashing one object, back to back, for the MAC chosen
(HMAC-SHA256, OpenSSL) and the alternatives measured (keyed blake2b; xxh3-64, the
checksum, which is no MAC), as GB/s per size.
Rows of system `tandem-<transport>` and `tandem-<transport>+mac`: put and get of one
object per call through the same master and stores, one client without a secret and one
with, timed in alternating slices (so load on a shared machine falls on both alike).
Sizes: 4 KiB and a typical KV page object: SmolLM2-135M (the default model), 30 layers x
K and V x 16 tokens x 3 KV heads x 64 dims, fp32 (737,280 bytes; bf16 is half).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

import xxhash

from bench.pool_common import KIB, row, timed, timed_sync
from libs.common.pool.client import LocalMemory, PoolClient
from libs.common.pool.integrity import KvMac

PAGE = 30 * 2 * 16 * 3 * 64 * 4
SIZES = (("4 KiB", 4 * KIB), ("page fp32", PAGE))
SLICES = 4  # alternations of off/on per op and size


def mac_rows(seconds: float, max_iters: int) -> list[dict[str, Any]]:
    key = os.urandom(32)
    rows = []
    for label, size in (*SIZES, ("1 MiB", 1 << 20)):
        data = memoryview(os.urandom(size))
        hashes = {
            "hmac-sha256": lambda d: hmac.new(key, d, "sha256").hexdigest(),
            "blake2b-keyed": lambda d: hashlib.blake2b(d, key=key, digest_size=16).hexdigest(),
            "xxh3 (no MAC)": xxhash.xxh3_64_hexdigest,
        }
        for op, fn in hashes.items():
            lat = timed_sync(lambda i, fn=fn, d=data: fn(d), seconds / 4, max_iters)
            rows.append(row("mac", op, label, size, 1, lat))
    return rows


async def integrity_rows(client: PoolClient, engine, args) -> list[dict[str, Any]]:
    """put and get, integrity off and on, same master, stores, bus and engine."""
    buf = engine.allocate(4 << 20)
    buf[:] = os.urandom(len(buf))
    mem = LocalMemory.register(engine, buf)
    name = f"tandem-{args.transport}"
    clients = {name: client, f"{name}+mac": PoolClient(client.bus, engine, timeout=client.timeout,
                                                       mac=KvMac(os.urandom(32)))}  # fmt: skip
    rows = mac_rows(args.seconds, args.max_iters)
    for label, size in SIZES:
        # Half the put budget, shared by both clients: no eviction under the gets.
        puts = max(1, min(args.max_iters, (args.put_budget_mib << 20) // size // 4) // SLICES)
        lats: dict[tuple[str, str], list[float]] = {}
        keys: dict[str, list[str]] = {system: [] for system in clients}
        for part in range(SLICES):
            for system, c in clients.items():
                prefix = f"{system.replace('+', '-')}-{size}-{part}"
                lats.setdefault((system, "put"), []).extend(
                    await timed(_put(c, mem, size, keys[system], prefix), args.seconds / SLICES,
                                puts))  # fmt: skip
            for system, c in clients.items():
                lats.setdefault((system, "get"), []).extend(
                    await timed(_get(c, mem, size, keys[system]), args.seconds / SLICES,
                                args.max_iters // SLICES))  # fmt: skip
        for (system, op), lat in lats.items():
            rows.append(row(system, op, label, size, 1, lat))
        for system, c in clients.items():
            await c.remove(keys[system])
    return rows


def _put(client: PoolClient, mem: LocalMemory, size: int, keys: list[str], prefix: str):
    async def put_one(i: int) -> None:
        key = f"{prefix}-{i}"
        (result,) = await client.batch_put([key], mem, [0], [size])
        if not result.ok:
            raise RuntimeError(f"put {key}: {result.error}")
        keys.append(key)

    return put_one


def _get(client: PoolClient, mem: LocalMemory, size: int, keys: list[str]):
    async def get_one(i: int) -> None:
        (result,) = await client.batch_get([keys[i % len(keys)]], mem, [2 << 20], size)
        if not result.ok:
            raise RuntimeError(f"get: {result.error}")

    return get_one


def overheads(rows: list[dict[str, Any]]) -> list[str]:
    """p50 with integrity on minus off, per op and size, from this run's rows."""
    by = {(r["system"], r["op"], r["case"]): r for r in rows}
    out = []
    for (system, op, case), on in sorted(by.items()):
        off = by.get((system.removesuffix("+mac"), op, case))
        if system.endswith("+mac") and off is not None:
            out.append(f"{op} {case}: p50 {off['p50_us']:.0f} -> {on['p50_us']:.0f} us "
                       f"with MAC ({on['p50_us'] - off['p50_us']:+.0f} us)")  # fmt: skip
    return out
