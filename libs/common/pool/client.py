"""The KV pool client: what workers call to find, read and write page objects in the pool.

    client = PoolClient(bus, engine)                     # a connected Bus, a running engine
    mem = LocalMemory.register(engine, kv_buffer)        # or LocalMemory(view, region)
    n = await client.batch_exists(page_keys)             # leading keys present, 1 round trip
    got = await client.batch_get(page_keys[:n], mem, offsets, capacity=page_bytes)
    put = await client.batch_put(new_keys, mem, offsets, sizes=[page_bytes] * len(new_keys))

Bytes never cross NATS: the master says where (store segment descriptor + offset) and
the transfer engine moves them between `mem` and the stores' segments.

Guarantees:
  - batch_put: an object is visible only after all its replicas are written (two-phase:
    put_start -> write -> put_end; a failed write is revoked). A key already in the pool
    answers `exists` and is never overwritten. Each object's xxh3-64 checksum and, with a
    cluster secret (`mac`), its MAC tag over key and bytes (integrity.py), computed here
    from the bytes sent, are recorded by the master.
  - batch_get: the bytes at `offsets[i]` are valid only where `results[i].ok`. With a
    secret they must match the recorded MAC tag, made with this client's secret
    (`mac`); without one, the recorded checksum (`checksum`). A bad copy falls through to
    the next replica, and is reported to the master (which drops that replica) only when
    provably bad (see `_check`); a miss only when no replica was good. A read that ends
    after its lease (counted from when the request was sent) is refused
    (`lease_expired`): the store may have reused those bytes. Replicas are tried in turn
    when a store cannot be reached.
  - Errors that concern the whole call (the master unreachable, a malformed batch) raise
    `BusError`/`RemoteError`; per-object outcomes are in the results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from libs.common.bus.connection import Bus, BusError, RemoteError
from libs.common.log import get_logger
from libs.common.messages.control import InfoRequest
from libs.common.messages.pool import (
    PoolBadCopy,
    PoolCount,
    PoolDrop,
    PoolFound,
    PoolGetReply,
    PoolKeys,
    PoolNewObject,
    PoolPutFinish,
    PoolPutStart,
    PoolPutStartReply,
    PoolReplica,
    PoolStats,
)
from libs.common.pool.integrity import KvMac
from libs.common.transfer import RegionDescriptor, TransferEngine, TransferError
from libs.common.transfer.region import buffer_view

log = get_logger(__name__)

T = TypeVar("T")

# Keys per master request: keeps every message far below NATS's 1 MiB payload limit.
BATCH_KEYS = 256
# How long "no responders" (no master subscribed: dead, or restarting) is retried.
NO_MASTER_WAIT_S = 0.5


@dataclass(frozen=True)
class LocalMemory:
    """A registered local buffer: `view` (its bytes) and `region` (its descriptor)."""

    view: memoryview
    region: RegionDescriptor

    @classmethod
    def register(cls, engine: TransferEngine, buffer: Any) -> LocalMemory:
        return cls.of(buffer, engine.register(buffer))

    @classmethod
    def of(cls, buffer: Any, region: RegionDescriptor) -> LocalMemory:
        """Pair memory already registered (e.g. a worker's KV pool) with its descriptor."""
        view, _ = buffer_view(buffer)
        if view.nbytes != region.length:
            raise ValueError(f"region: {region.length} bytes, buffer has {view.nbytes}")
        return cls(view, region)


@dataclass(frozen=True)
class GetResult:
    """`error` is "" (ok), "missing", "too_large", "unreachable", "checksum", "mac" (no
    replica carried a tag this client's secret verifies), "lease_expired" or "pinned"
    (leased without a break for the master's --max-lease-pin: a miss until its lease ends);
    `size` is the object's size (bytes written when ok)."""

    key: str
    size: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class PutResult:
    """`error` is "" (stored), "exists", "full" or "failed" (a write or put_end failed)."""

    key: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


async def _all(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """asyncio.gather, but one call is awaited in place: gather would wrap it in a task, a
    loop turn more on a single get or put's critical path."""
    if len(calls) == 1:
        return [await calls[0]]
    return list(await asyncio.gather(*calls))


def checksum(data: Any) -> str:
    """xxh3-64 as 16 hex chars: the pool's object checksum."""
    return xxhash.xxh3_64_hexdigest(data)


class PoolClient:
    """Client of the KV pool; see the module docstring for the guarantees."""

    def __init__(
        self,
        bus: Bus,
        engine: TransferEngine,
        prefix: str = "tandem",
        timeout: float = 5.0,
        mac: KvMac | None = None,
    ):
        self.bus, self.engine, self.prefix, self.timeout = bus, engine, prefix, timeout
        # Who this client is to the master, which caps pending puts per client.
        self.client_id = getattr(bus, "name", "") or ""
        self.mac = mac  # None: integrity off (checksums only)
        if mac is None:
            log.warning("KV pool integrity OFF: no --kv-secret-file / TANDEM_KV_SECRET_FILE; "
                        "any NATS credential holder can put KV this worker will decode from "
                        "(docs/security.md)")  # fmt: skip
        else:
            log.info("KV pool integrity on (HMAC-SHA256 tags)", key_id=mac.key_id)

    def _subject(self, name: str) -> str:
        return f"{self.prefix}.pool.master.{name}"

    async def _ask(self, name: str, message: Any, reply_type: type) -> Any:
        # No master listening: fail within NO_MASTER_WAIT_S (the caller computes instead)
        # rather than after the whole timeout, which would add it to a request's latency.
        return await self.bus.request(self._subject(name), message, reply_type, self.timeout,
                                      responder_wait=NO_MASTER_WAIT_S)  # fmt: skip

    async def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading `keys` are in the pool (a prompt's cached prefix, in pages)."""
        found = 0
        for start in range(0, len(keys), BATCH_KEYS):
            chunk = list(keys[start : start + BATCH_KEYS])
            count = (await self._ask("exists", PoolKeys(chunk), PoolCount)).count
            found += count
            if count < len(chunk):
                break
        return found

    async def batch_get(
        self,
        keys: Sequence[str],
        memory: LocalMemory,
        offsets: Sequence[int],
        capacity: int | Sequence[int],
    ) -> list[GetResult]:
        """Read object `keys[i]` into `memory` at `offsets[i]` (room: `capacity[i]` bytes)."""
        caps = [capacity] * len(keys) if isinstance(capacity, int) else list(capacity)
        if not len(keys) == len(offsets) == len(caps):
            raise ValueError("keys, offsets and capacity: lengths differ")
        results: list[GetResult] = []
        for start in range(0, len(keys), BATCH_KEYS):
            end = start + BATCH_KEYS
            results += await self._get_chunk(keys[start:end], memory, offsets[start:end],
                                             caps[start:end])  # fmt: skip
        return results

    async def _get_chunk(
        self, keys: Sequence[str], memory: LocalMemory, offsets: Sequence[int], caps: list[int]
    ) -> list[GetResult]:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        reply = await self._ask("get", PoolKeys(list(keys)), PoolGetReply)
        found = reply.objects
        if len(found) != len(keys):
            raise BusError(f"{self._subject('get')}: {len(found)} answers, {len(keys)} keys")
        deadline = sent + reply.lease_ttl  # the master's lease began after `sent`
        results: dict[int, GetResult] = {}  # index -> outcome; every index has one at the end
        todo: dict[int, list[PoolReplica]] = {}  # index -> replicas left to try
        for i, obj in enumerate(found):
            if not obj.replicas:
                results[i] = GetResult(keys[i], 0, obj.error or "missing")
            elif obj.size > caps[i]:
                results[i] = GetResult(keys[i], obj.size, "too_large")
            else:
                todo[i] = list(obj.replicas)
        bad: list[PoolBadCopy] = []  # replicas whose bytes provably failed
        while todo:  # each round reads every pending key from its next replica
            groups: dict[str, list[int]] = {}
            for i, replicas in todo.items():
                groups.setdefault(replicas[0].store, []).append(i)
            reads = [
                self._transfer("read", memory, reply.segments[store],
                               [(offsets[i], todo[i][0].offset, found[i].size) for i in group],
                               store)
                for store, group in groups.items()
            ]  # fmt: skip
            outcomes = await _all(reads)
            for group, ok in zip(groups.values(), outcomes, strict=True):
                for i in group:
                    replica, obj = todo[i].pop(0), found[i]
                    data = memory.view[offsets[i] : offsets[i] + obj.size]
                    error, provable = self._check(keys[i], data, obj) if ok else (
                        "unreachable", False)  # fmt: skip
                    if provable:
                        bad.append(PoolBadCopy(keys[i], replica.store, replica.offset,
                                               obj.checksum, obj.mac))  # fmt: skip
                    # A tag of another secret is the same on every replica: stop there.
                    if not error or not todo[i] or (error == "mac" and not provable):
                        del todo[i]
                        results[i] = GetResult(keys[i], obj.size, error)
        ordered = [results[i] for i in range(len(keys))]
        if loop.time() > deadline:
            log.error("pool read outlived its lease; bytes refused", keys=len(keys),
                      lease_ttl=reply.lease_ttl)  # fmt: skip
            # past the lease the store refuses reads too (the get's grant expired)
            late = ("", "unreachable")
            return [GetResult(r.key, r.size, "lease_expired") if r.error in late else r
                    for r in ordered]  # fmt: skip
        if bad:  # read within the lease: the bytes were the replica's, not a reused range
            await self._report_bad(bad)
        return ordered

    async def _transfer(
        self, kind: str, memory: LocalMemory, segment: dict[str, Any], ops: list, store: str
    ) -> bool:
        """One batch with one store; False (logged) when it failed."""
        try:
            remote = RegionDescriptor.from_dict(segment)
            if kind == "read":
                await self.engine.read(memory.region, remote, ops)
            else:
                await self.engine.write(memory.region, remote, ops)
        except (TransferError, OSError, ValueError) as e:
            # ValueError: a descriptor or range that does not fit; another replica may.
            log.warning("pool transfer failed", kind=kind, store=store, error=str(e))
            return False
        return True

    def _check(self, key: str, data: memoryview, obj: PoolFound) -> tuple[str, bool]:
        """(error, provably bad) for bytes read as `obj`: "" (good), "checksum" or "mac".

        Provably bad: the bytes fail their checksum (integrity off), or a tag made with
        this client's secret (integrity on). A tag of another secret, or none, is a miss
        here but not evidence against the copy: a reader with the wrong secret must not
        report good data (docs/pool.md, "Integrity")."""
        if self.mac is None:
            return ("", False) if checksum(data) == obj.checksum else ("checksum", True)
        if not self.mac.mine(obj.mac):
            return "mac", False
        return ("", False) if self.mac.verify(key, data, obj.mac) else ("mac", True)

    async def _report_bad(self, bad: list[PoolBadCopy]) -> None:
        """Ask the master to drop bad replicas (it drops only exact matches). A failed
        report is logged: the reader's results stand either way."""
        log.error("pool replicas failed their checksum or MAC; reporting them", count=len(bad),
                  copies=[(b.key, b.store) for b in bad[:8]])  # fmt: skip
        try:
            await self._ask("drop", PoolDrop(bad), PoolCount)
        except (BusError, RemoteError) as e:
            log.warning("bad replicas not reported", error=str(e))

    async def batch_put(
        self,
        keys: Sequence[str],
        memory: LocalMemory,
        offsets: Sequence[int],
        sizes: Sequence[int],
        replicas: int = 0,
    ) -> list[PutResult]:
        """Store `memory[offsets[i] : offsets[i] + sizes[i]]` as object `keys[i]`.

        `replicas` 0 uses the master's default. Raises RemoteError (400/413) when the
        master refuses the batch as a whole (bad key, size below --min-object-size or above
        --max-object-size: 400/413; this client's pending puts over --max-pending-puts:
        429).
        """
        if not len(keys) == len(offsets) == len(sizes):
            raise ValueError("keys, offsets and sizes: lengths differ")
        results: list[PutResult] = []
        for start in range(0, len(keys), BATCH_KEYS):
            end = start + BATCH_KEYS
            results += await self._put_chunk(keys[start:end], memory, offsets[start:end],
                                             sizes[start:end], replicas)  # fmt: skip
        return results

    async def _put_chunk(
        self,
        keys: Sequence[str],
        memory: LocalMemory,
        offsets: Sequence[int],
        sizes: Sequence[int],
        replicas: int,
    ) -> list[PutResult]:
        view = memory.view
        for off, size in zip(offsets, sizes, strict=True):
            if off < 0 or size < 0 or off + size > view.nbytes:
                raise ValueError(f"offsets/sizes: {off}+{size} outside local memory")
        spans = [view[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        sums = [checksum(data) for data in spans]
        macs = [self.mac.tag(k, d) for k, d in zip(keys, spans, strict=True)] if self.mac else [
            ""] * len(keys)  # fmt: skip
        objects = [PoolNewObject(*o) for o in zip(keys, sizes, sums, macs, strict=True)]
        start = PoolPutStart(objects, replicas, client=self.client_id)
        reply = await self._ask("put_start", start, PoolPutStartReply)
        if len(reply.slots) != len(keys):
            raise BusError(f"{self._subject('put_start')}: answers do not match the keys")
        errors = {i: slot.status for i, slot in enumerate(reply.slots) if slot.status != "ok"}
        by_store: dict[str, tuple[list[tuple[int, int, int]], list[int]]] = {}
        for i, slot in enumerate(reply.slots):
            if i not in errors:
                for replica in slot.replicas:
                    entry = by_store.setdefault(replica.store, ([], []))
                    entry[0].append((offsets[i], replica.offset, sizes[i]))
                    entry[1].append(i)
        writes = [self._transfer("write", memory, reply.segments[store], ops, store)
                  for store, (ops, _) in by_store.items()]  # fmt: skip
        for (_, written), ok in zip(by_store.values(), await _all(writes), strict=True):
            if not ok:
                errors.update({i: "failed" for i in written})
        done = [k for i, k in enumerate(keys) if i not in errors]
        failed = [k for i, k in enumerate(keys) if errors.get(i) == "failed"]
        ends = [self._ask("put_end", PoolPutFinish(reply.put_id, done), PoolKeys)] if done else []
        if failed:
            ends.append(self._ask("put_revoke", PoolPutFinish(reply.put_id, failed), PoolCount))
        finished = await _all(ends)
        visible = set(finished[0].keys) if done else set()
        return [PutResult(k, errors.get(i, "" if k in visible else "failed"))
                for i, k in enumerate(keys)]  # fmt: skip

    async def remove(self, keys: Sequence[str]) -> int:
        """Remove objects (bytes freed once no reader holds a lease); returns how many."""
        return (await self._ask("remove", PoolKeys(list(keys)), PoolCount)).count

    async def stats(self) -> PoolStats:
        return await self._ask("stats", InfoRequest(), PoolStats)
