"""WorkerService: one worker process, the core composed with its roles.

    role "prefill"  PrefillRole                  tandem.prefill.<id>.prefill, .status
    role "decode"   DecodeRole                   tandem.decode.<id>.generate
    role "both"     DecodeRole + PrefillRole     all three, on one core: one engine and one
                                                 KV pool, prefilling its own prompts and
                                                 those of other decode workers

The service's endpoints are its roles' endpoints; start starts the core, then the roles;
stop stops the core (a role holds nothing the core does not stop). Load reports name the
role ("both" reports as `tandem.workers.both.<id>.load`): the router counts a `both`
worker as a decode worker that may prefill for itself and as a prefill worker for the
others, and /health is ready with one `both` worker alone.
"""

from __future__ import annotations

from typing import Any, Protocol

from libs.common.bus.connection import Endpoint
from libs.common.config import WorkerConfig
from libs.common.service import BaseService
from libs.common.worker.core import WorkerCore
from libs.common.worker.decode import DecodeRole
from libs.common.worker.prefill import PrefillRole

DESCRIPTIONS = {
    "prefill": "Tandem prefill worker",
    "decode": "Tandem decode worker",
    "both": "Tandem worker (prefill and decode)",
}
ROLES = tuple(DESCRIPTIONS)


class Role(Protocol):
    """What a role adds to the core: endpoints, and what it starts after the core."""

    def endpoints(self) -> list[Endpoint]: ...

    async def start(self) -> None: ...


class WorkerService(BaseService):
    """A model replica on the bus serving `role`: "prefill", "decode" or "both".

    `max_queue_delay` is the decode role's admission bound (--max-queue-delay; 0: none)."""

    def __init__(self, config: WorkerConfig, role: str, *, max_queue_delay: float = 0.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
        super().__init__(config)
        self.role = role
        self.description = DESCRIPTIONS[role]
        self.core = WorkerCore(self.bus, config, role)
        self.decode = DecodeRole(self.core, max_queue_delay) if role != "prefill" else None
        self.prefill = PrefillRole(self.core) if role != "decode" else None
        self.roles: list[Role] = [r for r in (self.decode, self.prefill) if r is not None]

    def endpoints(self) -> list[Endpoint]:
        return [endpoint for role in self.roles for endpoint in role.endpoints()]

    def details(self) -> dict[str, Any]:
        return self.core.details()

    async def on_start(self) -> None:
        await self.core.start()
        for role in self.roles:
            await role.start()

    async def on_stop(self) -> None:
        await self.core.stop()
