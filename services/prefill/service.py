"""The prefill worker service."""

from __future__ import annotations

from typing import Any

from libs.common.service import BaseService
from services.prefill.config import PrefillConfig


class PrefillService(BaseService):
    """A model replica that computes prompts and hands their KV to a decode worker."""

    description = "Tandem prefill worker"

    def __init__(self, config: PrefillConfig):
        super().__init__(config)
        self.config: PrefillConfig = config

    def details(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "model": self.config.model,
            "page_size": self.config.page_size,
            "transport": self.config.transport,
        }
