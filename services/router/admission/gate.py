"""Step 2 of a request (services/router/requests/lifecycle.py): may it start now?

Checked after parsing and before tokenizing, so a refused request costs no CPU. In order:
503 when no decode worker is live; 429 when the router holds `--max-pending` requests
(running and waiting); 429 with Retry-After when the tenant is over its tokens per minute,
when its queue is full, when the expected wait (tokens queued ahead / the measured
throughput, plus the time until a slot frees when none is free) is over
`--max-queue-wait`, or when the request's deadline (its x-request-deadline-ms header)
would pass before it starts. Otherwise it runs at once when the workers have a free slot
(their reported max running requests) or its tenant is under its share of the slots (a
quarter past the capacity at most), and the tenant is under its max concurrency; or it
waits in its tenant's queue (wfq.py) for `--queue-timeout` seconds at most. Every
admitted request gives its slot back through `leave`, whatever way it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from services.router.admission.limits import Throughput, TokenBucket
from services.router.admission.tenants import Tenant
from services.router.admission.wfq import Entry, FairQueue
from services.router.errors import ApiError, no_workers


@dataclass(frozen=True)
class Limits:
    max_pending: int  # requests held at once (running and waiting)
    max_queue_wait: float  # seconds of expected wait over which a request is refused
    queue_timeout: float  # seconds a request may wait in its queue at most


@dataclass
class Ticket:
    """An admitted request: what it took, to give back."""

    tenant: Tenant
    cost: int
    slots: int
    entry: Entry
    prompt_cost: int = 0  # the prompts' part of `cost` (the estimate the queue counts)


def too_many(message: str, code: str, retry_after: float = 1.0) -> ApiError:
    seconds = 1 if not math.isfinite(retry_after) else max(1, math.ceil(retry_after))
    return ApiError(429, message, code=code, headers={"Retry-After": str(seconds)})


class Gate:
    """The router's admission: its slots, the tenants' queues, counts and rates.

    `capacity()` is the requests the decode workers can run at once (None: unknown, then
    --max-pending bounds alone); `live()` whether any decode worker is live.
    """

    def __init__(
        self,
        limits: Limits,
        capacity: Callable[[], int | None],
        live: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limits, self.capacity, self.live, self.clock = limits, capacity, live, clock
        self.queue = FairQueue()
        self.held = 0  # requests running or waiting (the --max-pending bound)
        self.running = 0  # slots of running requests
        self._tenant_running: dict[str, int] = {}
        self._weights: dict[str, float] = {}  # the weight of each tenant seen
        self._buckets: dict[str, TokenBucket] = {}
        self.throughput = Throughput(clock())
        self._live: set[Entry] = set()  # running requests
        self._duration: float | None = None  # a request's measured run time (moving average)

    # --- generation requests ----------------------------------------------------------

    async def enter(
        self, tenant: Tenant, cost: int, slots: int = 1, priority: int = 0,
        deadline: float | None = None, *, prompt_cost: int = 0,
    ) -> Ticket:  # fmt: skip
        """Admit a request (at once or after its wait in the queue) or raise ApiError.
        `deadline` is on this gate's clock: the latest time it may start; `prompt_cost` the
        prompts' part of `cost`."""
        if not self.live():
            raise no_workers("no decode worker is live; retry shortly")
        self._check_held()
        now = self.clock()
        self._charge(tenant, cost, now)
        entry = Entry(tenant.name, tenant.weight, cost, slots, priority, tenant.max_concurrency)
        self._weights[tenant.name] = tenant.weight
        ticket = Ticket(tenant, cost, slots, entry, prompt_cost)
        # At once when nothing waits and it fits, or when its tenant is under its share of
        # the slots (nothing waiting is fairly ahead of it).
        fits_now = (not len(self.queue) and self._fits(entry)) or self._under_share(entry)
        if self._tenant_may_run(entry) and fits_now:
            self._start(entry)
            return ticket
        try:
            self._check_wait(entry, tenant, deadline, now)
        except ApiError:
            self._refund(tenant, cost)
            raise
        return await self._wait(ticket, entry, deadline, now)

    def leave(self, ticket: Ticket, used_tokens: int, completion_tokens: int | None = None) -> None:
        """A request admitted by `enter` ended (any way): its slots and unused tokens back.

        The throughput counts what the queue counts (`expected_wait` divides one by the
        other): the prompts' estimate and the tokens generated (`completion_tokens`; when
        not given, `used_tokens`). A measured prompt (the chat template's tokens too) is
        longer than the estimate the queue holds, so counting it would make the queue
        look faster than it drains."""
        now = self.clock()
        self.held -= 1
        self.running -= ticket.slots
        name = ticket.tenant.name
        self._tenant_running[name] -= ticket.slots
        if not self._tenant_running[name]:
            del self._tenant_running[name]
        self._refund(ticket.tenant, ticket.cost - used_tokens)
        self._live.discard(ticket.entry)
        took = now - ticket.entry.started
        self._duration = took if self._duration is None else 0.9 * self._duration + 0.1 * took
        measured = used_tokens
        if completion_tokens is not None:
            measured = ticket.prompt_cost + completion_tokens
        self.throughput.finished(measured, now)
        self.throughput.running(self.running > 0, now)
        self.pump()

    def pump(self) -> None:
        """Start the waiting requests that may run now (after a request ended, or when the
        workers' capacity may have grown: the service calls it on each load report)."""
        while len(self.queue):
            entry = self.queue.pop(self._tenant_may_run, self._fits, self._under_share)
            if entry is None:
                return
            if entry.waiter is not None and not entry.waiter.done():
                self._start(entry)
                entry.waiter.set_result(None)

    def expected_wait(self, tenant: Tenant, priority: int = 0) -> float:
        """Seconds a new request of `tenant` would wait: tokens served before it / the
        measured throughput."""
        ahead = self.queue.ahead(tenant.name, tenant.weight, priority)
        return ahead / self.throughput.per_s(self.clock())

    # --- cheap requests (tokenize, render, count_tokens, pins) -------------------------

    @contextlib.asynccontextmanager
    async def light(self, tenant: Tenant, cost: int) -> AsyncIterator[None]:
        """A request that runs no generation: counted against --max-pending while it runs,
        charged to the tenant's tokens per minute, refused when the tenant is at its max
        concurrency. It never waits."""
        self._check_held()
        bound = tenant.max_concurrency
        if bound and self._tenant_running.get(tenant.name, 0) >= bound:
            raise too_many(
                f"tenant {tenant.name!r} is at its max concurrency of {bound}", "tenant_concurrency"
            )
        self._charge(tenant, cost, self.clock())
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1

    # --- the parts --------------------------------------------------------------------

    def _check_held(self) -> None:
        bound = self.limits.max_pending
        if self.held >= bound:
            raise too_many(
                f"the router is at its bound of {bound} requests in flight", "too_many_requests"
            )

    def _charge(self, tenant: Tenant, cost: int, now: float) -> None:
        if not tenant.tokens_per_minute:
            return
        bucket = self._buckets.get(tenant.name)
        if bucket is None:
            bucket = self._buckets[tenant.name] = TokenBucket(tenant.tokens_per_minute, now)
        wait = bucket.take(cost, now)
        if wait == 0.0:
            return
        per = tenant.tokens_per_minute
        if math.isinf(wait):
            message = f"the request's {cost} tokens are over {tenant.name!r}'s {per} a minute"
        else:
            message = f"tenant {tenant.name!r} is over its {per} tokens per minute"
        raise too_many(message, "tokens_per_minute", wait if math.isfinite(wait) else 60.0)

    def _refund(self, tenant: Tenant, tokens: int) -> None:
        bucket = self._buckets.get(tenant.name)
        if bucket is not None and tokens > 0:
            bucket.give_back(tokens, self.clock())

    def slot_wait(self, now: float) -> float:
        """Seconds until a running request is expected to end (its start plus the measured
        run time), 0 before any request has ended."""
        if self._duration is None or not self._live:
            return 0.0
        return max(0.0, min(e.started for e in self._live) + self._duration - now)

    def _check_wait(self, entry: Entry, tenant: Tenant, deadline: float | None, now: float):
        priority = entry.priority
        bound = tenant.max_queue
        if bound and self.queue.queued(tenant.name) >= bound:
            raise too_many(
                f"tenant {tenant.name!r}'s queue is full ({bound} requests)", "tenant_queue_full"
            )
        wait = self.expected_wait(tenant, priority)
        if not self._fits(entry):  # every slot busy: it starts when one frees, after those ahead
            wait += self.slot_wait(now)
        if deadline is not None and now + wait > deadline:
            raise too_many(
                f"the request cannot start before its deadline (expected wait {wait:.2f} s)",
                "deadline_unreachable",
                wait,
            )
        if wait > self.limits.max_queue_wait:
            raise too_many(
                f"the expected wait ({wait:.1f} s) is over the router's bound of "
                f"{self.limits.max_queue_wait:g} s",
                "queue_wait",
                wait,
            )

    async def _wait(
        self, ticket: Ticket, entry: Entry, deadline: float | None, now: float
    ) -> Ticket:
        entry.waiter = asyncio.get_running_loop().create_future()
        self.queue.push(entry)
        self.held += 1
        self.pump()  # a slot may be free for it (the queue held only tenants at their bound)
        timeout = self.limits.queue_timeout
        late = deadline is not None and deadline - now < timeout
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - now))
        try:
            await asyncio.wait_for(asyncio.shield(entry.waiter), timeout)
        except BaseException as e:
            if entry.waiter.done() and not entry.waiter.cancelled():
                self.leave(ticket, 0)  # started just as it was given up: give it back
            else:
                entry.waiter.cancel()
                self.queue.remove(entry)
                self.held -= 1
                self._refund(ticket.tenant, ticket.cost)
                self.pump()  # it may have been the head that did not fit
            if isinstance(e, TimeoutError):
                what = (
                    "its deadline passed"
                    if late
                    else f"--queue-timeout ({self.limits.queue_timeout:g} s) passed"
                )
                code = "deadline_passed" if late else "queue_timeout"
                raise too_many(f"the request waited in its queue until {what}", code) from None
            raise
        return ticket

    def _start(self, entry: Entry) -> None:
        if entry.waiter is None:
            self.held += 1
        self.running += entry.slots
        entry.started = self.clock()
        self._live.add(entry)
        self._tenant_running[entry.tenant] = self._tenant_running.get(entry.tenant, 0) + entry.slots
        self.throughput.running(True, self.clock())

    def _tenant_may_run(self, entry: Entry) -> bool:
        running = self._tenant_running.get(entry.tenant, 0)
        return not entry.limit or not running or running + entry.slots <= entry.limit

    def _fits(self, entry: Entry) -> bool:
        """Whether `entry` may start now: the slots are free, or its tenant runs less than
        its share of them (capacity x weight / the weights of the tenants running or
        waiting), up to a quarter of the capacity past it. Without the share a light
        tenant beside a flood waits for the flood's requests to end, which come in waves
        (requests that start together end together)."""
        capacity = self.capacity()
        if capacity is None:
            return True  # --max-pending alone
        if not self.running or self.running + entry.slots <= capacity:
            return True
        return self._under_share(entry)

    def _under_share(self, entry: Entry) -> bool:
        """Its tenant runs less than its share of the slots, and the gate is at most a
        quarter of the capacity past it with `entry`."""
        capacity = self.capacity()
        if capacity is None or self.running + entry.slots > capacity + max(1, capacity // 4):
            return False
        active = {*self._tenant_running, *self.queue.tenants(), entry.tenant}
        total = sum(self._weights.get(t, 1.0) for t in active)
        share = capacity * entry.weight / total
        return self._tenant_running.get(entry.tenant, 0) + entry.slots <= share


GATE: web.AppKey[Gate] = web.AppKey("admission_gate", Gate)
