"""The router service: loads the tokenizer, follows the workers and the KV events, serves HTTP.

on_start: tokenizer (no weights) -> load-report subscription -> KV events stream
          (replayed into the index) -> liveness task (on a LoopClock: this loop's stalls
          are not the workers' silence) -> heartbeat, from the loop and a beat process
          (workers cancel the requests of a router whose heartbeats stop) -> HTTP listener
          (connections.py)
on_stop:  HTTP listener closes (in-flight requests get --drain-timeout, then are
          cancelled, which cancels them on the workers) -> tasks -> heartbeat ->
          subscriptions
"""

from __future__ import annotations

import asyncio
import functools
import gc
import random
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from nats.aio.msg import Msg

from libs.common.bus.connection import BusError
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.generation_config import FIELDS, model_sampling_defaults
from libs.common.engine.load.source import load_tokenizer
from libs.common.log import get_logger
from libs.common.messages.control import (
    InfoRequest,
    LoadReport,
    MessageError,
    RouterHeartbeat,
    ServiceInfo,
)
from libs.common.service import BaseService
from services.router.admission.gate import Gate, Limits
from services.router.admission.tenants import load_keys
from services.router.api.app import build_app
from services.router.api.connections import ConnectionLimits, Listener
from services.router.config import RouterConfig
from services.router.defaults import SamplingDefaults, merge_defaults
from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.heartbeat import Heartbeat, new_instance_id
from services.router.metrics import RouterMetrics
from services.router.routing.kv_feed import KvFeed
from services.router.routing.kv_index import KvIndex
from services.router.routing.loop_clock import LoopClock
from services.router.routing.policy import PolicyConfig
from services.router.routing.selector import RouteSelector
from services.router.routing.workers import WorkerTable
from services.router.state import RouterState

log = get_logger(__name__)

_PRUNE_S = 0.25


class RouterService(BaseService):
    """HTTP in, NATS out. `port` is the bound HTTP port once started."""

    description = "Tandem router: OpenAI-compatible HTTP API and KV-aware routing"

    def __init__(self, config: RouterConfig):
        super().__init__(config)
        self.config: RouterConfig = config
        self._runner: web.AppRunner | None = None
        self._listener: Listener | None = None
        self.port: int | None = None
        self.state: RouterState | None = None
        self._feed: KvFeed | None = None
        self._load_sub: Any = None
        self._prune_task: asyncio.Task | None = None
        self._clock = LoopClock(_PRUNE_S)  # made again at start, next to the WorkerTable
        self.instance = new_instance_id()  # this process, as workers know it
        self._heartbeat: Heartbeat | None = None
        self._gate: Gate | None = None

    def details(self) -> dict[str, Any]:
        return {
            "host": self.config.host,
            "port": self.port or self.config.port,
            "model": self.config.model_name,
            "instance": self.instance,
        }

    async def on_start(self) -> None:
        cfg = self.config
        await self._refuse_a_taken_id()
        loop = asyncio.get_running_loop()
        tokenizer, model_id, max_len = await loop.run_in_executor(None, load_tokenizer, cfg.model)
        defaults = await loop.run_in_executor(None, load_defaults, cfg.model, cfg.sampling_flags)
        keys = await loop.run_in_executor(None, load_keys, cfg.api_key, cfg.api_keys_file)
        self._clock = LoopClock(_PRUNE_S)  # the router's stalls are not its workers' silence
        workers = WorkerTable(cfg.worker_timeout, self._clock, cfg.worker_forget_timeout)
        index = KvIndex(cfg.kv_index_max_keys)
        metrics = RouterMetrics(cfg.model_name, cfg.service_id, self.instance)
        policy = PolicyConfig(
            prefill_page_weight=cfg.prefill_page_weight,
            pool_page_weight=cfg.pool_page_weight,
            running_weight=cfg.running_weight,
            decode_kv_weight=cfg.decode_kv_weight,
            disagg_threshold=cfg.disagg_threshold,
        )
        prefix = cfg.subject_prefix
        queue_time = metrics.queue.labels(cfg.model_name)
        state = self.state = RouterState(
            config=cfg,
            bus=self.bus,
            tokenizer=tokenizer,
            model_id=model_id,
            max_model_len=max_len,
            workers=workers,
            index=index,
            selector=RouteSelector(workers, index, policy, model_id, metrics, random.Random()),
            dispatcher=Dispatcher(
                self.bus,
                prefix,
                workers,
                cfg.request_timeout,
                cfg.queue_timeout,
                on_accepted=queue_time.observe,
                on_migrated=metrics.migrations.labels(cfg.model_name).inc,
                router_id=cfg.service_id,
                instance=self.instance,
            ),
            metrics=metrics,
            sampling_defaults=defaults,
            instance=self.instance,
        )
        # The grammar pool's processes (each builds the tokenizer) start before the first request.
        await loop.run_in_executor(None, lambda: state.grammars)
        self._load_sub = await self.bus.subscribe(
            self.subject("workers", "*", "*", "load"), self._on_load
        )
        self._feed = KvFeed(self.bus, prefix, index, cfg.kv_stream_max_age, cfg.kv_stream_max_mb)
        await self._feed.start()
        state.replayed = lambda: self._feed is not None and self._feed.replayed
        self._prune_task = asyncio.create_task(self._prune(), name="router-prune")
        beat = RouterHeartbeat(router=self.instance, service_id=cfg.service_id,
                               interval=cfg.heartbeat_interval, timeout=cfg.heartbeat_timeout,
                               timestamp=0.0)  # fmt: skip
        self._heartbeat = Heartbeat(self.bus, prefix, beat, cfg.heartbeat_max_stall,
                                    cfg.log_level, cfg.log_format)  # fmt: skip
        await self._heartbeat.start()
        limits = ConnectionLimits.of(cfg)
        admission = Limits(cfg.max_pending, cfg.max_queue_wait, cfg.queue_timeout)
        live = lambda: bool(state.selector.eligible("decode"))  # noqa: E731
        capacity = functools.partial(decode_capacity, workers, cfg.max_running)
        self._gate = Gate(admission, capacity, live)
        self._runner = web.AppRunner(
            build_app(state, keys, self._gate),
            access_log=None,
            handler_cancellation=True,  # a client that goes away cancels its request
            shutdown_timeout=cfg.drain_timeout,
            **limits.runner_options(),
        )
        await self._runner.setup()
        assert self._runner.server is not None  # set up
        # Our listener, not a web.TCPSite: it counts and times connections (connections.py).
        refused = state.metrics.connections_refused
        listener = self._listener = Listener(
            self._runner.server, limits, lambda limit: refused.labels(limit).inc()
        )
        state.metrics.connections.set_function(lambda: listener.open)
        self.port = await listener.start(cfg.host, cfg.port)
        # What start-up made (modules, tokenizer, grammar cache: ~0.5M objects) lives as long
        # as the process: frozen out of the cyclic collector, whose full passes would walk it
        # all, holding the GIL and so the event loop (0.3-0.8 s a pass on this host).
        gc.freeze()
        log.info("router listening", url=f"http://{cfg.host}:{self.port}", model_id=model_id)

    async def _refuse_a_taken_id(self) -> None:
        """Several routers serve one cluster (docs/operations.md, "Several routers"), each
        with its own --service-id: it names the subjects its tokens come back on, and its
        request ids are its own counter, so two routers under one id would read each
        other's tokens. A live router answering `info` under ours: refuse to start."""
        subject = self.subject(self.name, self.config.service_id, "info")
        try:
            other = await self.bus.request(subject, InfoRequest(), ServiceInfo, timeout=1.0,
                                           responder_wait=0.1)  # fmt: skip
        except BusError:  # nobody answers (no responders, or a timeout): the id is free
            return
        raise RuntimeError(
            f"--service-id {self.config.service_id!r} is taken by a live router "
            f"(instance {other.details.get('instance')}); give each router its own"
        )

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = LoadReport.decode(msg.data)
        except MessageError as e:
            log.warning("unreadable load report dropped", subject=msg.subject, error=str(e))
            return
        joined = self.state is not None and self.state.workers.update(report)
        if self._gate is not None:
            self._gate.pump()  # the workers' capacity may have grown
        if joined and self.state is not None:
            log.info("worker joined", worker=report.worker, role=report.role)
            self._forget()  # back as another instance: its old cache entries go at once
            if report.model_id != self.state.model_id:
                log.warning(
                    "worker serves another model; it will not be routed to",
                    worker=report.worker,
                    model_id=report.model_id,
                    router_model_id=self.state.model_id,
                )

    async def _prune(self) -> None:
        state = self.state
        while state is not None:
            await asyncio.sleep(_PRUNE_S)
            late = self._clock.tick()
            if late > _PRUNE_S:  # this loop stalled: read the reports queued meanwhile first
                log.warning("router event loop stalled", seconds=round(late, 2))
                continue
            for w in state.workers.prune():
                log.warning("worker left rotation (no load report)", worker=w.id, role=w.role)
                state.metrics.forget_worker(w)
            self._forget()

    def _forget(self) -> None:
        """Drop the index entries of the workers that are really gone (routing/workers.py)."""
        if self.state is not None:
            for w in self.state.workers.forget():
                log.info("worker forgotten; its KV index entries dropped", worker=w.id)
                self.state.index.drop_source(w.id)

    async def on_stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        task, self._prune_task = self._prune_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        feed, self._feed = self._feed, None
        if feed is not None:
            await feed.stop()
        if self.state is not None:
            await self.state.dispatcher.stop()
            await asyncio.to_thread(self.state.close_grammars)
            self.state.cpu.shutdown(wait=False)
        beat, self._heartbeat = self._heartbeat, None
        if beat is not None:  # after the drain: the workers keep its requests until here
            await beat.stop()
        sub, self._load_sub = self._load_sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as e:  # the connection may already be closed
                log.debug("load subscription not removed", error=str(e))


def decode_capacity(workers: WorkerTable, most: int = 0) -> int | None:
    """The requests the live decode (and `both`) workers run at once, by their reports, at
    most `most` (--max-running, 0: no bound of its own); None while a worker does not say
    (an older worker) and no --max-running is set: --max-pending bounds alone."""
    slots = [w.report.max_running for w in workers.live("decode", "both")]
    known = sum(slots) if slots and all(slots) else None
    if not most:
        return known
    return most if known is None else min(most, known)


def load_defaults(model: str, flags: Mapping[str, int | float | None]) -> SamplingDefaults:
    """The defaults for `model` (a --model value) under `flags`, logged once with the source
    of each field (reads the model's metadata: run it off the event loop)."""
    stored, source = model_sampling_defaults(model)
    defaults = merge_defaults(stored, source, flags)
    engine = SamplingParams()
    log.info(
        "sampling defaults",
        **{
            name: f"{defaults.values[name]} ({defaults.sources[name]})"
            if name in defaults.values
            else f"{getattr(engine, name)} (engine default)"
            for name in FIELDS
        },
    )
    return defaults
