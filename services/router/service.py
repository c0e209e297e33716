"""The router service: HTTP API (aiohttp) on top of the common service lifecycle."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from libs.common.log import get_logger
from libs.common.service import BaseService
from services.router.config import RouterConfig

log = get_logger(__name__)


class RouterService(BaseService):
    """Serves HTTP; `GET /health` says whether the router can reach NATS."""

    description = "Tandem router: OpenAI-compatible HTTP API and KV-aware routing"

    def __init__(self, config: RouterConfig):
        super().__init__(config)
        self.config: RouterConfig = config
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def details(self) -> dict[str, Any]:
        return {"host": self.config.host, "port": self.port or self.config.port}

    async def on_start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("router listening", url=f"http://{self.config.host}:{self.port}")

    async def _health(self, _request: web.Request) -> web.Response:
        ok = self.bus.connected
        return web.json_response(
            {"status": "ok" if ok else "unavailable", "nats": ok}, status=200 if ok else 503
        )

    async def on_stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
