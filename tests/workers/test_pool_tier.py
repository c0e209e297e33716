"""The pool as L3: pages one worker computed serve another worker's prompt, exactly."""

import asyncio

from libs.common.messages.control import KvEvent
from tests.workers.conftest import generate, prompt_ids


async def _watch_pool_stores(bus, pages: int):
    """An event set once the pool's stores announced `pages` stored pages, and the sub."""
    pooled: set[str] = set()
    all_pooled = asyncio.Event()

    async def on_event(msg) -> None:
        event = KvEvent.decode(msg.data)
        if event.tier == "pool" and event.kind == "stored":
            pooled.update(event.keys)
            if len(pooled) >= pages:
                all_pooled.set()

    return all_pooled, await bus.subscribe("tandem.kv.events.>", on_event)


async def test_prompt_computed_on_one_prefill_worker_hits_the_pool_on_another(bus):
    prompt = prompt_ids(100, seed=80)  # 6 full pages
    all_pooled, sub = await _watch_pool_stores(bus, pages=6)
    try:
        first = await generate(bus, "l3-1", prompt, decode="d1", prefill="p1", max_tokens=6)
        assert first.usage.cached_tokens.get("pool", 0) == 0
        # the write-through runs after the reply; the store's events say when it landed
        await asyncio.wait_for(all_pooled.wait(), 20)
        second = await generate(bus, "l3-2", prompt, decode="d2", prefill="p2", max_tokens=6)
    finally:
        await sub.unsubscribe()
    assert second.token_ids == first.token_ids and second.text == first.text
    assert second.usage.cached_tokens["pool"] == 6 * 16
    assert second.usage.cached_tokens["device"] == 0


async def test_decode_writes_finished_conversation_pages_for_the_next_turn(bus):
    prompt = prompt_ids(40, seed=81)
    turn1 = await generate(bus, "turn-1", prompt, decode="d1", max_tokens=30)
    await asyncio.sleep(2.0)  # write-back of prompt + answer pages, off the critical path
    follow_up = prompt + turn1.token_ids + prompt_ids(10, seed=82)[1:]
    turn2 = await generate(bus, "turn-2", follow_up, decode="d2", max_tokens=4)
    # the first (40 + 30 - 1) // 16 = 4 pages were computed on d1; d2 reads them
    assert turn2.usage.cached_tokens["pool"] == 4 * 16


async def test_pool_read_that_fails_falls_back_to_compute_with_equal_output(bus, cluster):
    """Runs last in this session: it kills the only store (the master still lists its
    objects until the store's heartbeats are missed, so reads are tried and fail)."""
    _, local = cluster
    prompt = prompt_ids(100, seed=83)
    all_pooled, sub = await _watch_pool_stores(bus, pages=6)
    try:
        first = await generate(bus, "fail-1", prompt, decode="d1", prefill="p1", max_tokens=6)
        await asyncio.wait_for(all_pooled.wait(), 20)
    finally:
        await sub.unsubscribe()
    local.procs["cache_store"].kill()  # kill -9: its segment is gone mid-flight
    local.procs["cache_store"].wait()
    again = await generate(bus, "fail-2", prompt, decode="d2", prefill="p2", max_tokens=6)
    assert again.error is None and again.token_ids == first.token_ids
    assert again.usage.cached_tokens.get("pool", 0) == 0
