"""The decode worker service."""

from __future__ import annotations

from typing import Any

from libs.common.service import BaseService
from services.decode.config import DecodeConfig


class DecodeService(BaseService):
    """A model replica that receives prompt KV into reserved pages and generates tokens."""

    description = "Tandem decode worker"

    def __init__(self, config: DecodeConfig):
        super().__init__(config)
        self.config: DecodeConfig = config

    def details(self) -> dict[str, Any]:
        return {
            "role": "decode",
            "model": self.config.model,
            "page_size": self.config.page_size,
            "transport": self.config.transport,
        }
