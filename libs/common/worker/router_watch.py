"""Which routers are alive, as a worker hears them: requests are keyed by their router.

A request's key on a worker is (router instance, router-local request id), as one string
(`request_key`): two routers may send the same id, and a client's X-Request-Id is never a
key (services/router/dispatch/heartbeat.py). Every router process publishes a `RouterHeartbeat`
every `interval` on `<prefix>.routers.<router>.heartbeat`, saying its own `timeout`; a
worker that has heard nothing from a router for that long (`RouterWatch.silent`) cancels
every request it holds from it: its client went with it (a kill -9 sends no cancel).

Silence counts from the latest of: the router's last heartbeat, the request's arrival,
and this worker's last reconnect to NATS or stall of its own event loop (while its own
connection is down, or just back, or its loop was blocked, it cannot have heard anyone:
the beats wait unread; no router is blamed for that). A request with no router (a direct
client on the bus) is never watched.
"""

from __future__ import annotations

import asyncio
import time

from libs.common.messages.control import RouterHeartbeat

UNHEARD_TIMEOUT = 3.0  # a router whose heartbeat has not been heard yet: its timeout
MIN_TIMEOUT, MAX_TIMEOUT = 0.5, 60.0  # a heartbeat's `timeout` is held to this range
MAX_ROUTER_ID = 64  # longer ids are not a router's (16 hex chars): the beat is ignored
MAX_ROUTERS = 4096  # routers in the table; a new one past this (a flood) is not recorded


def request_key(router: str, request_id: str) -> str:
    """The worker-side key of a request: `<router>/<request_id>`, or the id alone without a
    router (`/` is in neither: router ids are hex, request ids `[A-Za-z0-9_-]`)."""
    return f"{router}/{request_id}" if router else request_id


class RouterWatch:
    """Last heartbeat (monotonic time) and declared timeout of each router heard.

    Anyone on the bus may publish a heartbeat, so one must not hurt the requests of
    others: a router's timeout never shrinks (a forged short timeout under a real
    router's id cannot bring its cancels forward), ids are bounded in length and the
    table in size (kept in order of last beat; the dead are forgotten first).
    """

    def __init__(self) -> None:
        self._heard: dict[str, tuple[float, float]] = {}
        self.reconnected_at = time.monotonic()

    def heard(self, beat: RouterHeartbeat) -> bool:
        """Record `beat`; False if it was ignored (a bad id, or the table is full)."""
        if not 0 < len(beat.router) <= MAX_ROUTER_ID:
            return False
        now = time.monotonic()
        # A timeout out of reason (a bad sender) neither cancels at once nor holds forever.
        timeout = min(max(beat.timeout, MIN_TIMEOUT), MAX_TIMEOUT)
        previous = self._heard.pop(beat.router, None)
        if previous is not None:
            timeout = max(timeout, previous[1])
        else:
            self._forget_dead(now)
            if len(self._heard) >= MAX_ROUTERS:
                return False
        self._heard[beat.router] = (now, timeout)  # at the end: the table is in beat order
        return True

    async def pause(self, seconds: float) -> float:
        """Sleep `seconds` and return the monotonic time after. A wake-up later than asked
        by more than `seconds` is this worker's own stall: silence counts again from now."""
        asked = time.monotonic() + seconds
        await asyncio.sleep(seconds)
        now = time.monotonic()
        if now - asked > seconds:
            self.reconnected_at = now  # deaf meanwhile, as while disconnected
        return now

    def _forget_dead(self, now: float) -> None:
        """Drop routers silent past their timeout from the front (the least recently heard):
        their requests are cancelled either way (an unknown router counts from the
        request's arrival)."""
        while self._heard:
            router, (last, timeout) = next(iter(self._heard.items()))
            if now - last <= timeout:
                return
            del self._heard[router]

    def silent(self, router: str, since: float, now: float) -> float | None:
        """Seconds `router` has been silent, when past its timeout (None: alive, or not
        watched). `since` is when the request arrived here."""
        if not router:
            return None
        last, timeout = self._heard.get(router, (since, UNHEARD_TIMEOUT))
        quiet = now - max(last, since, self.reconnected_at)
        return quiet if quiet > timeout else None
