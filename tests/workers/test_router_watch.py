"""Workers' view of routers' liveness (libs/common/worker/router_watch.py): pure, no processes."""

import asyncio
import time

from libs.common.messages.control import RouterHeartbeat
from libs.common.worker.router_watch import (
    MAX_ROUTER_ID,
    MAX_ROUTERS,
    UNHEARD_TIMEOUT,
    RouterWatch,
    request_key,
)


def _beat(router: str, timeout: float = 2.0) -> RouterHeartbeat:
    return RouterHeartbeat(router=router, service_id="r", interval=0.5, timeout=timeout,
                           timestamp=0.0)  # fmt: skip


def test_the_same_request_id_from_two_routers_is_two_keys():
    assert request_key("aa", "same-id") != request_key("bb", "same-id")
    assert request_key("", "same-id") == "same-id"  # a direct client: the id alone


def test_a_router_is_silent_only_past_the_timeout_it_declared():
    watch = RouterWatch()
    watch.reconnected_at = 0.0
    watch.heard(_beat("aa", timeout=2.0))
    now = time.monotonic()
    assert watch.silent("aa", since=0.0, now=now + 1.9) is None
    assert watch.silent("aa", since=0.0, now=now + 2.1) is not None
    watch.heard(_beat("aa"))  # a new beat: alive again
    now = time.monotonic()
    assert watch.silent("aa", since=0.0, now=now + 1.9) is None


def test_no_router_is_blamed_for_the_workers_own_reconnect():
    watch = RouterWatch()
    watch.heard(_beat("aa"))
    now = time.monotonic()
    watch.reconnected_at = now + 5.0  # we were cut off: nobody could be heard
    assert watch.silent("aa", since=0.0, now=now + 6.0) is None
    assert watch.silent("aa", since=0.0, now=now + 7.5) is not None


def test_an_unheard_router_counts_from_the_requests_arrival_and_no_router_is_never_watched():
    watch = RouterWatch()
    watch.reconnected_at = 0.0
    since = time.monotonic()
    assert watch.silent("never", since, since + UNHEARD_TIMEOUT - 0.1) is None
    assert watch.silent("never", since, since + UNHEARD_TIMEOUT + 0.1) is not None
    assert watch.silent("", since, since + 1e6) is None


def test_a_heartbeats_timeout_is_held_to_a_sane_range():
    watch = RouterWatch()
    watch.reconnected_at = 0.0
    watch.heard(_beat("neg", timeout=-1.0))
    watch.heard(_beat("huge", timeout=1e9))
    now = time.monotonic()
    assert watch.silent("neg", since=0.0, now=now + 0.1) is None  # not cancelled at once
    assert watch.silent("huge", since=0.0, now=now + 61.0) is not None  # nor held forever


def test_a_later_beat_cannot_shorten_a_routers_timeout():
    """A forged beat under a real router's id with the shortest timeout does not bring the
    cancel of its requests forward: the longest timeout heard for an id holds."""
    watch = RouterWatch()
    watch.reconnected_at = 0.0
    watch.heard(_beat("aa", timeout=2.0))
    watch.heard(_beat("aa", timeout=0.5))  # forged
    now = time.monotonic()
    assert watch.silent("aa", since=0.0, now=now + 1.9) is None
    assert watch.silent("aa", since=0.0, now=now + 2.1) is not None


def test_the_table_is_bounded_in_id_length_and_in_routers_and_keeps_the_live_ones():
    watch = RouterWatch()
    watch.reconnected_at = 0.0
    assert not watch.heard(_beat("x" * (MAX_ROUTER_ID + 1)))
    assert not watch.heard(_beat(""))
    assert watch.heard(_beat("live", timeout=60.0))
    for i in range(MAX_ROUTERS + 100):  # a flood of fresh ids
        watch.heard(_beat(f"evil{i}", timeout=60.0))
    assert len(watch._heard) == MAX_ROUTERS
    now = time.monotonic()
    assert watch.silent("live", since=0.0, now=now + 1.0) is None  # not pushed out


def test_dead_routers_make_room_for_new_ones():
    watch = RouterWatch()
    for i in range(MAX_ROUTERS):
        watch.heard(_beat(f"old{i}", timeout=0.5))
    time.sleep(0.6)  # every one is past its timeout
    assert watch.heard(_beat("new"))
    assert len(watch._heard) == 1


async def test_no_router_is_blamed_for_the_workers_own_stall():
    watch = RouterWatch()
    watch.heard(_beat("aa", timeout=0.5))
    since = time.monotonic()
    sweep = asyncio.create_task(watch.pause(0.05))
    await asyncio.sleep(0)  # the sweep is asleep now
    time.sleep(1.0)  # noqa: ASYNC251 - the stall itself: aa's beats would wait unread
    now = await sweep
    assert watch.silent("aa", since, now) is None
    assert watch.silent("aa", since, now + 0.6) is not None  # silence counts from the stall


async def test_a_sweep_on_time_leaves_a_silent_router_silent():
    watch = RouterWatch()
    watch.reconnected_at = 0.0
    watch.heard(_beat("aa", timeout=0.5))
    await asyncio.sleep(0.6)  # aa silent past its timeout; this loop ran meanwhile
    now = await watch.pause(0.2)
    assert watch.silent("aa", 0.0, now) is not None
