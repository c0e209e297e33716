"""The dispatcher on a real nats-server: chunk ordering, retry before the first token,
back-pressure, cancel on early exit.

The decode side here is `ScriptedDecodeResponder`, a minimal NATS responder and *not* a
worker: real workers cannot be made to deliver chunks out of order, fail exactly before
their first token or refuse on cue, which is what these tests need. Real workers are in
test_router_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest

from libs.common.bus.connection import Bus, Endpoint, HandlerError
from libs.common.messages.control import (
    CancelRequest,
    GenerateAccepted,
    GenerateRequest,
    LoadReport,
    SamplingSpec,
    TokenChunk,
)
from services.router.dispatch.dispatcher import Dispatcher
from services.router.errors import ApiError
from services.router.routing.policy import Route
from services.router.routing.workers import WorkerTable


def chunk(rid, index, ids, finish=None):
    return TokenChunk(request_id=rid, index=index, token_ids=ids, worker="x", text="t" * len(ids),
                      finish_reason=finish)  # fmt: skip


class ScriptedDecodeResponder:
    """Answers `tandem.decode.<wid>.generate` and publishes `script(rid)` on the stream.

    `script` returns chunks to publish, or raises HandlerError to refuse the request.
    """

    def __init__(self, url: str, wid: str, script):
        self.bus = Bus(url, f"scripted-{wid}", connect_timeout=5, request_timeout=5)
        self.wid, self.script, self.seen = wid, script, []
        self.requests: list[GenerateRequest] = []

    async def start(self) -> None:
        await self.bus.connect()
        await self.bus.add_service(
            "scripted-decode",
            "0.0.0",
            "test responder",
            [
                Endpoint(
                    "generate",
                    f"tandem.decode.{self.wid}.generate",
                    GenerateRequest,
                    self._generate,
                )
            ],
        )

    async def _generate(self, req: GenerateRequest) -> GenerateAccepted:
        self.seen.append(req.request_id)
        self.requests.append(req)
        chunks = self.script(req.request_id)

        async def publish() -> None:
            await asyncio.sleep(0.05)
            for c in chunks:
                await self.bus.publish(req.stream_subject, c)

        self.bus.spawn(publish(), name="publish")
        return GenerateAccepted(request_id=req.request_id, decode_worker=self.wid,
                                num_reserved_pages=1)  # fmt: skip


def report(wid: str) -> LoadReport:
    return LoadReport(
        worker=wid, role="decode", model_id="m", page_size=16, kv_dtype="f32", waiting=0,
        running=0, waiting_prefill_tokens=0, free_pages=100, total_pages=100,
        tokens_per_s=0.0, max_model_len=100, timestamp=0.0,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def kept_alive(workers: WorkerTable, wid: str):
    """`wid`'s load reports keep coming (every 0.1 s, 10 s at most) inside the block, so
    it stays live while another worker's reports stop."""

    async def beat() -> None:
        for _ in range(100):
            workers.update(report(wid))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()


@contextlib.asynccontextmanager
async def setup(nats_url: str, scripts: dict, queue_timeout: float = 5.0):
    workers = WorkerTable(timeout=3.0)
    responders = [ScriptedDecodeResponder(nats_url, wid, s) for wid, s in scripts.items()]
    bus = Bus(nats_url, "router-test", connect_timeout=5, request_timeout=2)
    await bus.connect()
    try:
        for r in responders:
            await r.start()
            workers.update(report(r.wid))
        yield Dispatcher(bus, "tandem", workers, 2.0, queue_timeout), responders, bus, workers
    finally:
        for r in responders:
            await r.bus.close()
        await bus.close()


def route_to(*order):
    def route(exclude):
        left = [w for w in order if w not in exclude]
        return Route(left[0] if left else order[0], "", 0, "test")

    return route


async def collect(dispatcher, route, rid="r1", timeout=10.0):
    gen = dispatcher.generate(rid, [1, 2, 3], SamplingSpec(), route, timeout)
    async with contextlib.aclosing(gen) as chunks:
        return [c async for c in chunks]


async def test_chunks_are_yielded_in_index_order_without_duplicates(nats_url):
    def script(rid):
        return [chunk(rid, 3, [13, 14]), chunk(rid, 1, [11, 12]), chunk(rid, 0, [10]),
                chunk(rid, 1, [11, 12]), chunk(rid, 5, [], "length")]  # fmt: skip

    async with setup(nats_url, {"d1": script}) as (dispatcher, _, _, _):
        out = await collect(dispatcher, route_to("d1"))
    assert [c.index for c in out] == [0, 1, 3, 5]
    assert [t for c in out for t in c.token_ids] == [10, 11, 12, 13, 14]
    assert out[-1].finish_reason == "length"


async def test_error_before_the_first_token_is_retried_once_on_another_worker(nats_url):
    def failing(rid):
        return [chunk(rid, 0, [], "error")]

    def good(rid):
        return [chunk(rid, 0, [7], "stop")]

    async with setup(nats_url, {"d1": failing, "d2": good}) as (dispatcher, resp, _, _):
        out = await collect(dispatcher, route_to("d1", "d2"))
    assert out[-1].token_ids == [7]
    assert resp[0].seen == ["r1"] and resp[1].seen == ["r1-r1"]


async def test_error_after_tokens_on_every_worker_is_a_502_after_three_continuations(
    nats_url,
):
    def script(rid):
        return [chunk(rid, 0, [1]), chunk(rid, 1, [], "error")]

    async with setup(nats_url, {"d1": script, "d2": script}) as (dispatcher, resp, _, _):
        with pytest.raises(ApiError) as e:
            await collect(dispatcher, route_to("d1", "d2"))
    assert e.value.status == 502 and e.value.code == "worker_failed"
    assert resp[0].seen[0] == "r1" and resp[1].seen[0] == "r1-r1"  # the other one first
    assert len(resp[0].seen + resp[1].seen) == 4
    assert resp[1].requests[0].generated == [1]


async def test_failure_before_any_token_on_both_routes_is_a_503_with_retry_after(nats_url):
    def failing(rid):
        return [chunk(rid, 0, [], "error")]

    async with setup(nats_url, {"d1": failing, "d2": failing}) as (dispatcher, _, _, _):
        with pytest.raises(ApiError) as e:
            await collect(dispatcher, route_to("d1", "d2"))
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"


async def test_error_numbered_before_tokens_already_streamed_still_ends_the_stream(nats_url):
    # The prefill worker streamed token 0; the decode worker's handoff then failed and it
    # numbers its error chunk 0 (it never saw token 0): that must end the stream, not be
    # dropped as a duplicate while the client waits for the router's timeout.
    def script(rid):
        return [chunk(rid, 0, [1]), chunk(rid, 0, [], "error")]

    async with setup(nats_url, {"d1": script}) as (dispatcher, _, _, _):
        started = time.monotonic()
        with pytest.raises(ApiError) as e:
            await collect(dispatcher, route_to("d1"), timeout=30.0)
    assert e.value.status == 502 and time.monotonic() - started < 5


async def test_full_worker_is_waited_for_then_429(nats_url):
    def full(_rid):
        raise HandlerError(429, "KV pool full")

    async with setup(nats_url, {"d1": full}, queue_timeout=0.5) as (dispatcher, resp, _, _):
        started = time.monotonic()
        with pytest.raises(ApiError) as e:
            await collect(dispatcher, route_to("d1"))
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    assert len(resp[0].seen) >= 3 and time.monotonic() - started < 5


async def test_leaving_early_publishes_a_cancel_for_the_request(nats_url):
    def script(rid):
        return [chunk(rid, i, [i]) for i in range(50)]

    async with setup(nats_url, {"d1": script}) as (dispatcher, _, bus, workers):
        cancels: list[str] = []

        async def on_cancel(msg):
            cancels.append(CancelRequest.decode(msg.data).request_id)

        await bus.subscribe("tandem.cancel", on_cancel)
        gen = dispatcher.generate("r9", [1], SamplingSpec(), route_to("d1"), 10)
        async with contextlib.aclosing(gen) as chunks:
            async for _ in chunks:
                break
        await bus.nc.flush()
        for _ in range(50):
            if cancels:
                break
            await asyncio.sleep(0.02)
        assert cancels == ["r9"] and workers.get("d1").inflight == set()


async def test_silent_worker_fails_over_before_the_first_token(nats_url):
    def silent(_rid):
        return []  # accepts, then never streams

    def good(rid):
        return [chunk(rid, 0, [5], "stop")]

    async with setup(nats_url, {"d1": silent, "d2": good}) as (dispatcher, resp, _, workers):
        workers.timeout = 0.5  # d1's reports "stop" (no more updates) and it leaves rotation
        async with kept_alive(workers, "d2"):
            out = await collect(dispatcher, route_to("d1", "d2"))
    assert out[-1].token_ids == [5] and resp[1].seen == ["r1-r1"]


async def test_a_prefill_worker_is_owed_only_the_prompt_tokens_it_has_not_cached(nats_url):
    """Branches of a fork on a prefix one prefill worker holds: counting their whole
    prompts as its queued work made the idle worker look cheaper (docs/programs.md)."""
    owed: list[int] = []
    workers_ref: list[WorkerTable] = []

    def script(rid):  # runs when the request reaches the decode side: the route owes it
        owed.append(workers_ref[0].get("p1").pending_prefill_tokens)
        return [chunk(rid, 0, [7], "stop")]

    async with setup(nats_url, {"d1": script}) as (dispatcher, _, _, workers):
        workers_ref.append(workers)
        workers.update(msgspec.structs.replace(report("p1"), role="prefill"))
        route = lambda exclude: Route("d1", "p1", 2, "test")  # noqa: E731
        gen = dispatcher.generate("r1", list(range(40)), SamplingSpec(), route, 10.0)
        async with contextlib.aclosing(gen) as chunks:
            out = [c async for c in chunks]
        left = workers.get("p1").pending_prefill_tokens
    assert out[-1].token_ids == [7]
    assert owed == [40 - 2 * 16]  # 2 cached pages of 16 tokens are not its work
    assert left == 0  # paid back at the first token
