"""Which routers are alive, as a worker hears them: requests are keyed by their router.

A request's key on a worker is (router instance, router-local request id), as one string
(`request_key`): two routers may send the same id, and a client's X-Request-Id is never a
key (services/router/heartbeat.py). Every router process publishes a `RouterHeartbeat`
every `interval` on `<prefix>.routers.<router>.heartbeat`, saying its own `timeout`; a
worker that has heard nothing from a router for that long (`RouterWatch.silent`) cancels
every request it holds from it: its client went with it (a kill -9 sends no cancel).

Silence counts from the latest of: the router's last heartbeat, the request's arrival,
and this worker's last reconnect to NATS (while its own connection is down, or just back,
it cannot have heard anyone: no router is blamed for that). A request with no router (a
direct client on the bus) is never watched.
"""

from __future__ import annotations

import time

from libs.common.messages.control import RouterHeartbeat

UNHEARD_TIMEOUT = 3.0  # a router whose heartbeat has not been heard yet: its timeout
MIN_TIMEOUT, MAX_TIMEOUT = 0.5, 60.0  # a heartbeat's `timeout` is held to this range
_FORGET_AFTER = 600.0  # routers silent this long leave the table (bounded memory)


def request_key(router: str, request_id: str) -> str:
    """The worker-side key of a request: `<router>/<request_id>`, or the id alone without a
    router (`/` is in neither: router ids are hex, request ids `[A-Za-z0-9_-]`)."""
    return f"{router}/{request_id}" if router else request_id


class RouterWatch:
    """Last heartbeat (monotonic time) and declared timeout of each router heard."""

    def __init__(self) -> None:
        self._heard: dict[str, tuple[float, float]] = {}
        self.reconnected_at = time.monotonic()

    def heard(self, beat: RouterHeartbeat) -> None:
        now = time.monotonic()
        # A timeout out of reason (a bad sender) neither cancels at once nor holds forever.
        timeout = min(max(beat.timeout, MIN_TIMEOUT), MAX_TIMEOUT)
        self._heard[beat.router] = (now, timeout)
        if len(self._heard) > 1024:  # routers come and go: drop the long gone
            for router, (last, _) in list(self._heard.items()):
                if now - last > _FORGET_AFTER:
                    del self._heard[router]

    def silent(self, router: str, since: float, now: float) -> float | None:
        """Seconds `router` has been silent, when past its timeout (None: alive, or not
        watched). `since` is when the request arrived here."""
        if not router:
            return None
        last, timeout = self._heard.get(router, (since, UNHEARD_TIMEOUT))
        quiet = now - max(last, since, self.reconnected_at)
        return quiet if quiet > timeout else None
