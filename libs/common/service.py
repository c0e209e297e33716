"""The lifecycle every Tandem service shares: start, serve until a signal, drain, stop.

    main(Cls, ConfigCls)
      -> config = ConfigCls.parse()            (--help, flags, TANDEM_* variables)
      -> setup_logging(); tracing.setup() when an OTLP endpoint is set (libs/common/tracing.py)
      -> service.start()   connect NATS (bounded retries), on_start(), register micro
                           service `tandem-<name>` with `info` + the service's endpoints
      -> wait for SIGTERM / SIGINT
      -> service.stop()    unregister (no new work), let in-flight work finish within
                           --drain-timeout, on_stop(), close NATS, send the last spans
      -> exit 0            (1 when start failed, e.g. NATS unreachable)

`stop()` is safe to call twice and on a half-started service.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from libs.common import __version__, event_loop, tracing
from libs.common.bus.connection import Bus, BusError, Endpoint
from libs.common.config import CommonConfig, redact_url
from libs.common.log import get_logger, setup_logging
from libs.common.messages.control import InfoRequest, ServiceInfo

log = get_logger(__name__)


class BaseService:
    """A service process. Subclasses override `endpoints`, `details`, `on_start`, `on_stop`."""

    description = "a Tandem service"

    def __init__(self, config: CommonConfig):
        self.config = config
        self.name = config.SERVICE
        self.started_at = time.time()
        self.bus = Bus(
            config.nats_url,
            name=f"tandem-{self.name}-{config.service_id}",
            connect_timeout=config.connect_timeout,
            request_timeout=config.request_timeout,
            credentials_file=config.nats_credentials_file,
        )
        self._stopping = False
        self._stopped = asyncio.Event()

    def subject(self, *parts: str) -> str:
        """A subject under the configured prefix: subject("router", "x") -> tandem.router.x."""
        return ".".join((self.config.subject_prefix, *parts))

    # --- what subclasses provide ---------------------------------------------------------

    def endpoints(self) -> list[Endpoint]:
        """Endpoints beyond `info`."""
        return []

    def details(self) -> dict[str, Any]:
        """Role-specific facts for `info` (model, page size, transport, listen address…)."""
        return {}

    async def on_start(self) -> None:
        """Called after NATS is connected and before endpoints are registered."""

    async def on_stop(self) -> None:
        """Called after endpoints stopped and in-flight work drained. Must be idempotent."""

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.bus.connect()
        await self.on_start()
        info = Endpoint(
            name="info",
            subject=self.subject(self.name, self.config.service_id, "info"),
            request_type=InfoRequest,
            handler=self._info,
        )
        await self.bus.add_service(
            name=f"tandem-{self.name}",
            version=__version__,
            description=self.description,
            endpoints=[info, *self.endpoints()],
            metadata={"service_id": self.config.service_id},
        )
        log.info("service started", **self.details())

    async def _info(self, _request: InfoRequest) -> ServiceInfo:
        return self.info()

    def info(self) -> ServiceInfo:
        return ServiceInfo(
            service=self.name,
            service_id=self.config.service_id,
            version=__version__,
            started_at=self.started_at,
            nats_url=redact_url(self.config.nats_url),
            details=self.details(),
        )

    async def stop(self) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            await self.bus.stop_services()
            cancelled = await self.bus.wait_in_flight(self.config.drain_timeout)
            if cancelled:
                log.warning("drain timeout: cancelled in-flight requests", count=cancelled)
            await self.on_stop()
        finally:
            await self.bus.close()
            await asyncio.to_thread(tracing.shutdown)  # the last spans leave (when on)
            self._stopped.set()
            log.info("service stopped")


async def serve(service: BaseService) -> int:
    """Start, wait for SIGTERM/SIGINT, stop. Returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except BusError as e:
        log.error("start failed", error=str(e))
        await service.stop()
        return 1
    except Exception:
        log.exception("start failed")
        await service.stop()
        return 1
    await stop.wait()
    log.info("signal received; draining", drain_timeout=service.config.drain_timeout)
    await service.stop()
    return 0


def main(
    service_cls: Callable[[Any], BaseService],
    config_cls: type[CommonConfig],
    argv: Sequence[str] | None = None,
) -> None:
    """Entry point of `python -m services.<name>`; `service_cls(config)` builds the service."""
    config = config_cls.parse(argv)
    setup_logging(
        config.log_level, config.log_format, service=config.SERVICE, service_id=config.service_id
    )
    if tracing.setup(config.SERVICE, config.service_id, tracing.endpoint(config.otlp_endpoint)):
        log.info("tracing on", otlp_endpoint=tracing.endpoint(config.otlp_endpoint))
    loop = event_loop.loop_name(config.event_loop)
    log.info("event loop", event_loop=loop)
    sys.exit(event_loop.run(serve(service_cls(config)), loop))
