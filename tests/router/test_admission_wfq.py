"""Admission's pure parts (services/router/admission/): the weighted fair queue, the
tokens-per-minute bucket, the throughput measure, and the gate's accounting on an
injectable clock. Milliseconds; no cluster."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.messages.control import LoadReport
from services.router.admission.gate import Gate, Limits
from services.router.admission.limits import START_TOKENS_PER_S, Throughput, TokenBucket
from services.router.admission.tenants import Tenant
from services.router.admission.wfq import Entry, FairQueue
from services.router.errors import ApiError
from services.router.routing.workers import WorkerTable


def anyone(_: Entry) -> bool:
    return True


def drain(q: FairQueue) -> list[Entry]:
    out = []
    while (e := q.pop(anyone, anyone)) is not None:
        out.append(e)
    return out


def test_a_light_tenant_is_served_before_most_of_a_floods_queue():
    q = FairQueue()
    for _ in range(16):
        q.push(Entry("flood", 1.0, cost=100))
    q.push(Entry("light", 1.0, cost=100))
    order = [e.tenant for e in drain(q)]
    assert order.index("light") <= 1, order  # without fairness it would be 16th


def test_tokens_not_requests_are_shared_between_equal_weights():
    q = FairQueue()
    for _ in range(10):
        q.push(Entry("big", 1.0, cost=1000))
        q.push(Entry("small", 1.0, cost=100))
    first = drain(q)[:11]
    # In the time one big request is served, ten small ones are.
    assert sum(e.tenant == "small" for e in first) >= 9, [e.tenant for e in first]


def test_weights_divide_the_tokens_served():
    q = FairQueue()
    for _ in range(30):
        q.push(Entry("heavy", 3.0, cost=10))
        q.push(Entry("one", 1.0, cost=10))
    first = [e.tenant for e in drain(q)[:20]]
    assert first.count("heavy") == 15 and first.count("one") == 5, first


def test_priority_orders_a_tenants_own_queue_lower_first():
    q = FairQueue()
    for i, p in enumerate((5, 0, -3, 0, 7)):
        q.push(Entry("t", 1.0, cost=1, priority=p, waiter=i))
    assert [e.waiter for e in drain(q)] == [2, 1, 3, 0, 4]


def test_an_idle_tenant_does_not_bank_its_share():
    q = FairQueue()
    for _ in range(50):
        q.push(Entry("busy", 1.0, cost=10))
    served = [q.pop(anyone, anyone) for _ in range(40)]
    assert all(e is not None and e.tenant == "busy" for e in served)
    for _ in range(10):
        q.push(Entry("late", 1.0, cost=10))
    nxt = [e.tenant for e in drain(q)[:10]]
    assert 4 <= nxt.count("late") <= 6, nxt  # alternates from now on, no catch-up burst


def test_a_tenant_at_its_bound_is_passed_over_and_a_big_head_blocks():
    q = FairQueue()
    q.push(Entry("capped", 1.0, cost=1))
    q.push(Entry("free", 1.0, cost=5))
    got = q.pop(lambda e: e.tenant != "capped", anyone)
    assert got is not None and got.tenant == "free"
    q.push(Entry("wide", 1.0, cost=1, slots=4))
    assert q.pop(lambda e: e.tenant != "capped", lambda e: e.slots <= 2) is None
    assert len(q) == 2


def test_removed_entries_are_never_served_and_counts_follow():
    q = FairQueue()
    a, b = Entry("t", 1.0, cost=7), Entry("t", 1.0, cost=9)
    q.push(a)
    q.push(b)
    assert q.remove(a) and not q.remove(a)
    assert len(q) == 1 and q.queued("t") == 1 and q.ahead("u", 1.0, 0) >= 0
    assert drain(q) == [b] and len(q) == 0 and q.queued("t") == 0


def test_ahead_counts_own_lower_priorities_and_others_fair_share():
    q = FairQueue()
    q.push(Entry("t", 1.0, cost=100, priority=0))
    q.push(Entry("t", 1.0, cost=50, priority=9))
    assert q.ahead("t", 1.0, 0) == 100  # the priority-9 one comes after
    for _ in range(5):
        q.push(Entry("u", 1.0, cost=100))
    # A new request of "v" (idle) starts now: nobody's tokens are ahead of it but the
    # heads' that start at the same virtual time.
    assert q.ahead("v", 1.0, 0) == 0
    assert q.ahead("t", 1.0, 0) == 200  # its own 100, and u's share in that time


def test_the_bucket_refuses_over_the_rate_and_says_when():
    b = TokenBucket(600, now=0.0)  # 10 tokens/s, 600 saved up
    assert b.take(600, 0.0) == 0.0
    assert b.take(50, 0.0) == pytest.approx(5.0)
    assert b.take(50, 5.0) == 0.0
    assert b.take(601, 100.0) == float("inf")
    b.give_back(10_000, 100.0)
    assert b.level == 600


def test_throughput_counts_busy_time_only():
    t = Throughput(now=0.0)
    assert t.per_s(0.0) == START_TOKENS_PER_S
    t.running(True, 0.0)
    t.finished(500, 1.0)
    t.running(False, 1.0)
    assert t.per_s(1.0) == pytest.approx(500.0)
    t.running(True, 100.0)  # an idle gap of 99 s does not count
    t.finished(500, 101.0)
    assert t.per_s(101.0) == pytest.approx(500.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gate(capacity: int | None = 1, **kw) -> Gate:
    limits = Limits(max_pending=kw.pop("max_pending", 8), max_queue_wait=kw.pop("wait", 10.0),
                    queue_timeout=kw.pop("queue_timeout", 5.0))  # fmt: skip
    return Gate(limits, lambda: capacity, lambda: True, kw.pop("clock", Clock()))


A, B = Tenant("a"), Tenant("b")


async def test_a_waiter_starts_when_the_running_one_leaves_and_slots_balance():
    g = gate(capacity=1)
    first = await g.enter(A, 10)
    waiting = asyncio.ensure_future(g.enter(B, 10))
    await asyncio.sleep(0)
    assert not waiting.done() and g.running == 1 and g.held == 2
    g.leave(first, 10)
    second = await asyncio.wait_for(waiting, 1)
    assert g.running == 1 and g.held == 1
    g.leave(second, 10)
    assert g.running == 0 and g.held == 0 and len(g.queue) == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_slot():
    g = gate(capacity=1)
    first = await g.enter(A, 10)
    waiting = asyncio.ensure_future(g.enter(A, 10))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(g.queue) == 0 and g.held == 1
    g.leave(first, 0)
    assert g.running == 0 and g.held == 0


async def test_an_expected_wait_over_the_bound_is_429_at_once_with_retry_after():
    g = gate(capacity=1, wait=1.0)
    await g.enter(A, 10)
    # Each waits for the tokens ahead of it: 0 and 0.6 s at the start value of 1000/s.
    queued = [asyncio.ensure_future(g.enter(A, 600)) for _ in range(2)]
    await asyncio.sleep(0)
    assert not any(q.done() for q in queued)  # both waiting, neither refused
    with pytest.raises(ApiError) as e:
        await g.enter(A, 10)  # 1.2 s ahead
    assert e.value.status == 429 and e.value.code == "queue_wait"
    assert int(e.value.headers["Retry-After"]) >= 1
    for q in queued:
        q.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_the_throughput_counts_the_prompt_estimate_and_the_tokens_generated():
    clock = Clock()
    g = gate(capacity=4, clock=clock)
    ticket = await g.enter(A, 100, prompt_cost=20)
    clock.now += 1.0
    g.leave(ticket, used_tokens=90, completion_tokens=40)  # a 50-token prompt measured
    assert g.throughput.per_s(clock()) == pytest.approx(60.0)  # 20 estimated + 40


async def test_a_deadline_before_the_expected_start_is_refused_at_once():
    clock = Clock()
    g = gate(capacity=1, clock=clock)
    await g.enter(A, 10)
    queued = asyncio.ensure_future(g.enter(A, 500))  # 0.5 s ahead of the next one
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as e:
        await g.enter(A, 10, deadline=0.1)
    assert e.value.status == 429 and e.value.code == "deadline_unreachable"
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)


async def test_over_the_tenants_tokens_per_minute_is_429_and_unused_tokens_come_back():
    g = gate(capacity=4)
    t = Tenant("metered", tokens_per_minute=100)
    ticket = await g.enter(t, 80)
    with pytest.raises(ApiError) as e:
        await g.enter(t, 30)
    assert e.value.status == 429 and e.value.code == "tokens_per_minute"
    assert int(e.value.headers["Retry-After"]) >= 1
    g.leave(ticket, 20)  # used 20 of the 80 it was charged
    g.leave(await g.enter(t, 30), 30)


async def test_a_tenant_at_its_max_concurrency_waits_while_another_runs():
    g = gate(capacity=4)
    capped = Tenant("capped", max_concurrency=1)
    first = await g.enter(capped, 10)
    waiting = asyncio.ensure_future(g.enter(capped, 10))
    other = await asyncio.wait_for(g.enter(B, 10), 1)  # not held up behind it
    assert not waiting.done()
    g.leave(first, 10)
    g.leave(await asyncio.wait_for(waiting, 1), 10)
    g.leave(other, 10)
    assert g.running == 0 and g.held == 0


async def test_max_pending_counts_waiting_and_running_requests():
    g = gate(capacity=1, max_pending=2)
    await g.enter(A, 1)
    waiting = asyncio.ensure_future(g.enter(A, 1))
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as e:
        await g.enter(B, 1)
    assert e.value.status == 429 and e.value.code == "too_many_requests"
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_a_waiter_past_the_queue_timeout_is_429_and_leaves_no_trace():
    g = gate(capacity=1, queue_timeout=0.05)
    first = await g.enter(A, 10)
    with pytest.raises(ApiError) as e:
        await g.enter(B, 10)
    assert e.value.status == 429 and e.value.code == "queue_timeout"
    assert len(g.queue) == 0 and g.held == 1
    g.leave(first, 10)
    assert g.held == 0 and g.running == 0


async def test_a_wide_head_that_gives_up_lets_the_next_one_start():
    g = gate(capacity=2)
    first = await g.enter(A, 10)
    wide = asyncio.ensure_future(g.enter(B, 10, slots=2))  # does not fit beside `first`
    await asyncio.sleep(0)
    narrow = asyncio.ensure_future(g.enter(A, 10))  # fits, but the fairest head blocks it
    await asyncio.sleep(0)
    assert not narrow.done()
    wide.cancel()
    await asyncio.gather(wide, return_exceptions=True)
    g.leave(await asyncio.wait_for(narrow, 1), 10)
    g.leave(first, 10)
    assert g.held == 0 and g.running == 0 and len(g.queue) == 0


def test_capacity_is_the_decode_workers_reported_slots_bounded_by_max_running():
    from services.router.service import decode_capacity

    def report(wid: str, role: str, slots: int) -> LoadReport:
        return LoadReport(worker=wid, role=role, model_id="m", page_size=16, kv_dtype="f",
                          waiting=0, running=0, waiting_prefill_tokens=0, free_pages=1,
                          total_pages=1, tokens_per_s=0.0, max_model_len=64, timestamp=0.0,
                          max_running=slots)  # fmt: skip

    table = WorkerTable(3.0)
    assert decode_capacity(table) is None and decode_capacity(table, 4) == 4
    for r in (report("d1", "decode", 8), report("b1", "both", 4), report("p1", "prefill", 99)):
        table.update(r)
    assert decode_capacity(table) == 12 and decode_capacity(table, 5) == 5
    table.update(report("d2", "decode", 0))  # an older worker: unknown
    assert decode_capacity(table) is None and decode_capacity(table, 5) == 5


async def test_a_deadline_before_a_slot_is_expected_to_free_is_refused_at_once():
    clock = Clock()
    g = gate(capacity=1, clock=clock)
    g.leave(await g.enter(A, 10), 10)  # no run time measured before: nothing to refuse on
    clock.now = 1.0
    g.leave(await g.enter(A, 10), 10)  # ran 0 s... then one that runs 1 s:
    running = await g.enter(A, 10)
    clock.now = 2.0
    g.leave(running, 10)
    assert g._duration is not None and g._duration > 0
    running = await g.enter(A, 10)  # started at 2.0, expected to end near 2.0 + duration
    clock.now = 2.01
    with pytest.raises(ApiError) as e:
        await g.enter(B, 10, deadline=2.02)
    assert e.value.code == "deadline_unreachable"
    waiting = asyncio.ensure_future(g.enter(B, 10, deadline=5.0))  # time enough: it waits
    await asyncio.sleep(0)
    assert not waiting.done() and len(g.queue) == 1
    g.leave(running, 10)
    g.leave(await asyncio.wait_for(waiting, 1), 10)
    assert g.held == 0 and g.running == 0


async def test_a_tenant_under_its_share_starts_past_a_full_gate_by_a_quarter_at_most():
    g = gate(capacity=4, max_pending=16)
    flood = [await g.enter(A, 10) for _ in range(4)]  # every slot A's
    more_a = asyncio.ensure_future(g.enter(A, 10))  # A is over its share (2 of 4): waits
    light = await asyncio.wait_for(g.enter(B, 10), 1)  # B runs nothing: starts at once
    assert g.running == 5
    second_b = asyncio.ensure_future(g.enter(B, 10))  # past capacity + a quarter: waits
    await asyncio.sleep(0)
    assert not more_a.done() and not second_b.done()
    g.leave(light, 10)  # B's slot back: its second request is the fairer head and starts
    await asyncio.wait_for(second_b, 1)
    assert not more_a.done()
    for t in flood:
        g.leave(t, 10)
    await asyncio.wait_for(more_a, 1)
