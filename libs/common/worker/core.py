"""The worker core: one model replica on the bus, whatever roles it serves.

    WorkerCore
      start:    load the engine (its KV pool allocated through the transfer engine, so
                peers can write it), register the pool, make sure the KV events stream
                exists, start the load-report loop, subscribe to cancels and to routers'
                heartbeats (a request whose router went silent is cancelled, router_watch.py)
      details:  role, model id, page size, KV dtype, transport, endpoint: what `info` shows
                and what a peer checks before pairing; speculation's draft totals
      stop:     stop the loops, the engine and the transfer engine (idempotent)

The roles (decode.py, prefill.py) call into it: they hold the requests they serve in
`held` (held.py: so a cancel, or a router gone silent, reaches them), count their prompt
backlog, output tokens and latencies in `load` (load.py: the load reports), and read and
write the pool through it. It calls no role.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.msg import Msg

from libs.common import tracing
from libs.common.bus.connection import Bus
from libs.common.bus.kv_events import KvEventPublisher, keep_kv_stream
from libs.common.config import WorkerConfig
from libs.common.engine.core.radix_cache import CacheEvent
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.engine import Engine
from libs.common.engine.step_loop import EngineCore
from libs.common.log import get_logger
from libs.common.messages.control import (
    MessageError,
    RouterHeartbeat,
)
from libs.common.pool.client import PoolClient
from libs.common.pool.integrity import KvMac, load_kv_mac
from libs.common.pool.tier import PoolTier
from libs.common.transfer import RegionDescriptor, TransferEngine, create_engine, default_transport
from libs.common.transfer.rdma.exchange import engine_options, serve_connect
from libs.common.worker.engine_setup import engine_config, speculation_stats
from libs.common.worker.held import HeldRequests
from libs.common.worker.load import WorkerLoad
from libs.common.worker.router_watch import RouterWatch

log = get_logger(__name__)


class WorkerCore:
    """The engine, transfer engine, pool tier and cluster feed one worker process shares
    among its roles. `role` ("prefill", "decode" or "both") names it in load reports.

    `engine`, `engine_core`, `transfer` and `kv_region` exist from `start` on: before it
    they raise RuntimeError (the roles serve requests only once the core has started)."""

    def __init__(self, bus: Bus, config: WorkerConfig, role: str) -> None:
        self.bus, self.config, self.role = bus, config, role
        self._engine: Engine | None = None
        self._transfer: TransferEngine | None = None
        self._kv_region: RegionDescriptor | None = None  # the KV pool, registered
        self.pool: PoolTier | None = None
        self.kv_mac: KvMac | None = None  # the cluster's KV secret: pool tags, handoff MACs
        self.events = KvEventPublisher(bus, config.subject_prefix, config.service_id, tier="device")
        self._pending_events: list[CacheEvent] = []
        self._events_wake = asyncio.Event()
        self._loops: list[asyncio.Task] = []
        self._cancel_sub: Any = None
        self.routers = RouterWatch()
        self.held = HeldRequests(self.routers)  # what serves each request, and its cancel
        self.load = WorkerLoad(config, role)  # what the load reports say

    def subject(self, *parts: str) -> str:
        """A subject under the configured prefix (as BaseService.subject)."""
        return ".".join((self.config.subject_prefix, *parts))

    # --- what start brings up ------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether the engine and the transfer engine are up (from start until stop)."""
        return self._engine is not None and self._transfer is not None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("worker not started: no engine")
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine_core(self) -> EngineCore:
        """The engine's step loop: its KV cache, scheduler and page hasher."""
        core = self.engine.core
        if core is None:
            raise RuntimeError("worker not started: the engine is not started")
        return core

    @property
    def transfer(self) -> TransferEngine:
        if self._transfer is None:
            raise RuntimeError("worker not started: no transfer engine")
        return self._transfer

    @transfer.setter
    def transfer(self, transfer: TransferEngine) -> None:
        self._transfer = transfer

    @property
    def kv_region(self) -> RegionDescriptor:
        """The KV pool's region in the transfer engine (peers address its pages in it)."""
        if self._kv_region is None:
            raise RuntimeError("worker not started: the KV pool is not registered")
        return self._kv_region

    @kv_region.setter
    def kv_region(self, region: RegionDescriptor) -> None:
        self._kv_region = region

    def _started_core(self) -> EngineCore | None:
        """The engine's step loop, or None before start (what `info` shows then)."""
        return self._engine.core if self._engine is not None else None

    # --- what the pairing check and `info` need --------------------------------------

    @property
    def transport(self) -> str:
        chosen = self.config.transport
        return default_transport() if chosen == "auto" else chosen

    @property
    def model_id(self) -> str:
        return core.model.model_id if (core := self._started_core()) else ""

    @property
    def kv_dtype(self) -> str:
        return core.kv_format if (core := self._started_core()) else ""

    @property
    def num_kv_pages(self) -> int:
        return core.kv_cache.num_pages if (core := self._started_core()) else 0

    @property
    def max_model_len(self) -> int:
        """The longest sequence this worker can serve: the model's context, or less when
        its KV pool is smaller (a longer one could never be scheduled here)."""
        if not (core := self._started_core()):
            return 0
        pool_tokens = self.num_kv_pages * self.config.page_size
        return min(core.model.config.max_position, pool_tokens)

    def details(self) -> dict[str, Any]:
        core, transfer = self._started_core(), self._transfer
        return {
            "role": self.role,
            "model": self.config.model,
            "model_id": self.model_id,
            "page_size": self.config.page_size,
            "kv_dtype": self.kv_dtype,
            "kv_pages": self.num_kv_pages,
            # Pages taken out of use for good (a KV handoff that could not be fenced).
            "retired_kv_pages": core.scheduler.retired_pages if core else 0,
            "transport": self.transport,
            "transfer_endpoint": transfer.endpoint if transfer else "",
            "transfer": transfer.info() if transfer else {},
            "prefix_cache": not self.config.no_prefix_cache,
            "pool": not self.config.no_pool,
            "active_requests": len(self.held),
            "speculation": speculation_stats(self.config, core),
        }

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        options = self.config.transfer_options(self.transport)
        prefix, sid = self.config.subject_prefix, self.config.service_id
        options.update(engine_options(self.transport, self.bus, prefix, sid))
        self._transfer = transfer = create_engine(self.transport, **options)
        await transfer.start()
        await serve_connect(self.bus, transfer, prefix, sid)
        self._engine = engine = Engine(
            engine_config(self.config),
            on_kv_event=self._on_kv_event,
            kv_allocator=transfer.allocate,
        )
        await engine.start()
        self._kv_region = transfer.register(self.engine_core.kv_cache.buffer)
        self.kv_mac = load_kv_mac(self.config.kv_secret_file)
        if self.kv_mac is None:
            log.warning("KV handoff verification OFF: no --kv-secret-file / "
                        "TANDEM_KV_SECRET_FILE; decode workers trust the KV bytes that "
                        "land in their reserved pages (dev mode)")  # fmt: skip
        if not self.config.no_pool and not self.config.no_prefix_cache:
            # Pool pages enter through the prefix cache, so the pool needs it on.
            client = PoolClient(self.bus, transfer, self.config.subject_prefix,
                                mac=self.kv_mac)  # fmt: skip
            self.pool = PoolTier(client, engine, transfer)
        await keep_kv_stream(self.bus, self.config.subject_prefix)
        self._cancel_sub = await self.bus.subscribe(self.subject("cancel"), self.held.on_cancel)
        await self.bus.subscribe(self.subject("routers", "*", "heartbeat"), self._on_heartbeat)
        self.bus.on_reconnect(self._on_reconnect)
        self._loops = [
            asyncio.create_task(self._load_loop(), name="load-reports"),
            asyncio.create_task(self._events_loop(), name="kv-events"),
            asyncio.create_task(
                self.held.sweep(lambda: self.bus.connected), name="router-liveness"
            ),
        ]
        log.info("transfer engine ready", transport=self.transport, endpoint=transfer.endpoint)

    async def stop(self) -> None:
        loops, self._loops = self._loops, []
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if self._pending_events and self.bus.connected:
            await self._flush_events()
        # Both leave at once, so `started` turns False before either stops.
        engine, self._engine = self._engine, None
        transfer, self._transfer = self._transfer, None
        if engine is not None:
            await engine.stop()
        if transfer is not None:
            await transfer.stop()

    # --- the pool (L3) ---------------------------------------------------------------------

    def page_keys(self, token_ids: list[int], num_tokens: int, cache_salt: str) -> list[str]:
        """Keys of the full pages among the first `num_tokens` tokens, salted with the
        request's `cache_salt` ("": none) as the engine salts them (none without a cache)."""
        hasher = self.engine_core.hasher
        if hasher is None:
            return []
        n = num_tokens // self.config.page_size * self.config.page_size
        return hasher.keys(token_ids[:n], cache_salt=cache_salt)

    def reusable(
        self, token_ids: list[int], params: SamplingParams, generated: list[int] | tuple = ()
    ) -> int:
        """How many leading tokens may come from a cache (the pool included): all but the
        last, and none whose logits the prompt's logprobs need (the engine's rule)."""
        n = len(token_ids) - 1
        if params.prompt_logits_from is not None and not generated:
            n = min(n, params.prompt_logits_from)
        return n

    def write_back(
        self, token_ids: list[int], num_tokens: int, cache_salt: str, *, request_id: str = ""
    ) -> None:
        """Copy computed full pages to the pool in the background (write-through)."""
        if self.pool is not None:
            keys = self.page_keys(token_ids, num_tokens, cache_salt)
            if keys:
                put = _pool_put(self.pool, keys, request_id, tracing.now())
                self.bus.spawn(put, name="pool-write-back")

    # --- routers' liveness (router_watch.py) ----------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.routers.heard(RouterHeartbeat.decode(msg.data))
        except MessageError as e:
            log.warning("bad router heartbeat", error=str(e))

    async def _on_reconnect(self) -> None:
        self.routers.reconnected_at = time.monotonic()

    # --- load reports and KV events --------------------------------------------------------

    async def _load_loop(self) -> None:
        subject = self.subject("workers", self.role, self.config.service_id, "load")
        interval = self.config.load_interval
        while True:
            started = time.monotonic()
            try:
                report = self.load.report(self.engine_core, self.model_id, self.kv_dtype,
                                          self.max_model_len, interval)  # fmt: skip
                await self.bus.publish(subject, report)
            except Exception as e:  # NATS down: the next report goes when it is back
                log.debug("load report not sent", error=str(e))
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _on_kv_event(self, event: CacheEvent) -> None:
        self._pending_events.append(event)
        self._events_wake.set()

    async def _events_loop(self) -> None:
        while True:
            await self._events_wake.wait()
            self._events_wake.clear()
            await self._flush_events()

    async def _flush_events(self) -> None:
        events, self._pending_events = self._pending_events, []
        await self.events.publish(events)


async def _pool_put(pool: PoolTier, keys: list[str], request_id: str, queued: int) -> None:
    """The write-through as a span of the request's trace: from `queued`, inside the
    phase that computed the pages, to its end, after that phase (off its critical path)."""
    with tracing.span("pool.put", request_id, start_ns=queued, pages=len(keys)):
        stored = await pool.write_back(keys)
        tracing.annotate(pages_written=stored, bytes=stored * pool.page_nbytes)
