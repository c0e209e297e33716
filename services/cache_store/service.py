"""The cache store service."""

from __future__ import annotations

from typing import Any

from libs.common.service import BaseService
from services.cache_store.config import CacheStoreConfig


class CacheStoreService(BaseService):
    """Contributes a memory segment to the pool; peers read and write it directly."""

    description = "Tandem cache store: a KV pool segment"

    def __init__(self, config: CacheStoreConfig):
        super().__init__(config)
        self.config: CacheStoreConfig = config

    def details(self) -> dict[str, Any]:
        return {
            "segment_size": self.config.segment_size,
            "segment_file": self.config.segment_file,
            "transport": self.config.transport,
        }
