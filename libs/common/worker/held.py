"""The requests a worker holds, and how they end early: a cancel, or their router's silence.

HeldRequests
  hold / release / serves:  the task serving a request (by `request_key`) and its router
  cancel:                   cancel its task (its own cleanup aborts it in the engine and
                            ends its stream); a cancel that comes before its request is
                            remembered (bounded) so the request is refused when it comes
  on_cancel:                a `CancelRequest` from the bus
  sweep:                    cancel every request whose router has gone silent past its
                            timeout (router_watch.py), every `_ROUTER_SWEEP_S`
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from libs.common.log import get_logger, request_context
from libs.common.messages.control import CancelRequest, MessageError
from libs.common.worker.router_watch import RouterWatch, request_key

log = get_logger(__name__)

_CANCELLED_KEPT = 4096  # early cancels remembered (request ids)
_ROUTER_SWEEP_S = 0.25  # how often held requests are checked against their router's silence


@dataclass
class Held:
    """A request this worker serves: the task serving it, the router it came from."""

    task: asyncio.Task
    router: str
    since: float = field(default_factory=time.monotonic)


class HeldRequests:
    """Request key (router_watch.request_key: router and request id) -> what serves it."""

    def __init__(self, routers: RouterWatch) -> None:
        self.routers = routers
        self._active: dict[str, Held] = {}
        # Cancels that came before their request was registered (a router that gave up
        # waiting for the reply): such a request is refused when it registers, instead of
        # running for nobody. Bounded, oldest dropped first.
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()

    def hold(self, key: str, router: str, task: asyncio.Task) -> None:
        """`task` serves request `key` for `router`, until `release`."""
        self._active[key] = Held(task, router)

    def release(self, key: str) -> None:
        self._active.pop(key, None)

    def __len__(self) -> int:
        return len(self._active)

    def serves(self, key: str) -> bool:
        """Whether request `key` is held here (accepted, not yet ended)."""
        return key in self._active

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = CancelRequest.decode(msg.data)
        except MessageError as e:
            log.warning("bad cancel message", error=str(e))
            return
        await self.cancel(request_key(cancel.router, cancel.request_id), cancel.reason)

    async def cancel(self, key: str, reason: str) -> None:
        """Drop request `key` if this worker serves it: its task is cancelled, and the task's
        own cleanup aborts it in the engine (freeing its pages) and ends its stream."""
        held = self._active.get(key)
        if held is not None:
            with request_context(key):
                log.info("request cancelled", reason=reason)
            held.task.cancel()
        else:
            self._cancelled[key] = None
            while len(self._cancelled) > _CANCELLED_KEPT:
                self._cancelled.popitem(last=False)

    def was_cancelled(self, key: str) -> bool:
        """True if a cancel for request `key` came before the request registered here."""
        return self._cancelled.pop(key, False) is None

    async def sweep(self, connected: Callable[[], bool]) -> None:
        """Cancel every request whose router has gone silent past its timeout; forever."""
        while True:
            now = await self.routers.pause(_ROUTER_SWEEP_S)  # our own stall blames no one
            if not connected():  # we hear no one now: nobody is to blame
                continue
            for key, held in list(self._active.items()):
                quiet = self.routers.silent(held.router, held.since, now)
                if quiet is not None and not held.task.done() and not held.task.cancelling():
                    await self.cancel(key, f"router {held.router} silent for {quiet:.1f}s (gone)")
