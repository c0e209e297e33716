"""The cache master service."""

from __future__ import annotations

from typing import Any

from libs.common.service import BaseService
from services.cache_master.config import CacheMasterConfig


class CacheMasterService(BaseService):
    """Keeps the pool's metadata in memory; stores and clients talk to it over NATS."""

    description = "Tandem cache master: KV pool metadata"

    def __init__(self, config: CacheMasterConfig):
        super().__init__(config)
        self.config: CacheMasterConfig = config

    def details(self) -> dict[str, Any]:
        return {
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "lease_ttl": self.config.lease_ttl,
        }
