"""Worker failure and cancel paths: each fails one request only and frees its pages."""

import asyncio
import time

import pytest

from libs.common.bus.connection import RemoteError
from libs.common.engine.core.kv_hash import PageHasher
from libs.common.messages.control import (
    CancelRequest,
    InfoRequest,
    KvEvent,
    LoadReport,
    PrefillRequest,
    PrefillResult,
    RequestStatus,
    RequestStatusReply,
    SamplingSpec,
    ServiceInfo,
)
from libs.common.transfer import RegionDescriptor, TransferError, create_engine
from tests.chaos.reports import free_pages
from tests.workers.conftest import generate, prompt_ids


async def test_cancel_ends_the_stream_and_frees_pages_on_both_workers(bus):
    before = {w: await free_pages(bus, w) for w in ("p1", "d1")}
    prompt = prompt_ids(40, seed=60)
    decoding = asyncio.Event()  # the stream's first chunk: prefilled, handed off, decoding

    async def on_chunk(msg) -> None:
        decoding.set()

    watch = await bus.subscribe("tandem.stream.cancel-1", on_chunk)
    task = asyncio.create_task(
        generate(bus, "cancel-1", prompt, decode="d1", prefill="p1", max_tokens=1000)
    )
    await asyncio.wait_for(decoding.wait(), 60)
    await watch.unsubscribe()
    # at once: a fixed sleep let a fast host (speculation on) finish all the tokens first
    await bus.publish("tandem.cancel", CancelRequest(request_id="cancel-1"))
    done = await asyncio.wait_for(task, 30)
    assert done.finish_reason == "abort"
    assert len(done.token_ids) < 1000
    for worker, free in before.items():
        assert await free_pages(bus, worker, want=free) == free


async def test_unreachable_prefill_worker_fails_the_request_and_releases_the_reservation(bus):
    before = await free_pages(bus, "d2")
    done = await generate(bus, "ghost-1", prompt_ids(50, seed=61), decode="d2",
                          prefill="ghost", max_tokens=4, timeout=30)  # fmt: skip
    assert done.finish_reason == "error" and "ghost stopped reporting" in done.error
    assert await free_pages(bus, "d2", want=before) == before
    ok = await generate(bus, "ghost-2", prompt_ids(20, seed=62), decode="d2", prefill="p2",
                        max_tokens=3)  # fmt: skip
    assert ok.error is None and len(ok.token_ids) == 3


async def test_transfer_refused_by_peer_fails_that_prefill_only(bus):
    info = await bus.request("tandem.decode.d1.info", InfoRequest(), ServiceInfo)
    region = {
        "v": 1, "transport": "tcp", "endpoint": info.details["transfer_endpoint"],
        "region_id": 999, "length": 1 << 30, "token": "00" * 16, "addr": 0, "rkey": 0,
    }  # fmt: skip
    before = await free_pages(bus, "p1")
    req = PrefillRequest(
        request_id="xfer-1", token_ids=prompt_ids(40, seed=63), sampling=SamplingSpec(),
        stream_subject="tandem.stream.xfer-1", decode_worker="d1", kv_region=region,
        page_indices=[0, 1, 2], skip_pages=0, model_id=info.details["model_id"],
        page_size=16, kv_dtype=info.details["kv_dtype"], kv_num_pages=10,
    )  # fmt: skip
    try:
        await bus.request("tandem.prefill.p1.prefill", req, PrefillResult, timeout=30)
        raise AssertionError("a transfer into an unknown region must fail")
    except RemoteError as e:
        assert e.code == 502 and "transfer" in e.message
    assert await free_pages(bus, "p1", want=before) == before
    ok = await generate(bus, "xfer-2", prompt_ids(20, seed=64), decode="d1", prefill="p1",
                        max_tokens=3)  # fmt: skip
    assert ok.error is None and len(ok.token_ids) == 3


async def test_kv_events_name_the_pages_each_worker_stored(bus):
    events: list[KvEvent] = []

    async def on_event(msg) -> None:
        events.append(KvEvent.decode(msg.data))

    sub = await bus.subscribe("tandem.kv.events.>", on_event)
    prompt = prompt_ids(70, seed=65)
    try:
        done = await generate(bus, "events-1", prompt, decode="d2", prefill="p1", max_tokens=4)
        await asyncio.sleep(0.5)
    finally:
        await sub.unsubscribe()
    info = await bus.request("tandem.prefill.p1.info", InfoRequest(), ServiceInfo)
    hasher = PageHasher(info.details["model_id"], info.details["kv_dtype"], 16)
    prompt_keys = hasher.keys(prompt)  # 4 full pages
    stored = {
        src: [k for e in events if e.source == src and e.kind == "stored" for k in e.keys]
        for src in ("p1", "d2")
    }
    assert stored["p1"] == prompt_keys
    assert all(e.tier == "device" for e in events if e.source in ("p1", "d2"))
    # the decode worker holds the prompt's pages too (and any full page of the output)
    full_seq = hasher.keys(prompt + done.token_ids[:-1])
    assert stored["d2"] == full_seq[: len(stored["d2"])] and len(stored["d2"]) >= len(prompt_keys)


async def test_a_prefill_write_after_the_handoff_ended_is_refused(bus):
    """The decode worker fences each handoff: the region it gives the prefill worker dies
    with the handoff, so a late writer (slow, paused, cut off) cannot reach freed pages."""
    captured: list[PrefillRequest] = []

    async def on_prefill(msg) -> None:  # a plain subscriber sees a copy of each request
        captured.append(PrefillRequest.decode(msg.data))

    sub = await bus.subscribe("tandem.prefill.p2.prefill", on_prefill)
    try:
        done = await generate(bus, "fence-1", prompt_ids(40, seed=64), decode="d1",
                              prefill="p2", max_tokens=3)  # fmt: skip
    finally:
        await sub.unsubscribe()
    assert done.error is None and len(done.token_ids) == 3
    (req,) = [r for r in captured if r.request_id == "fence-1"]
    remote = RegionDescriptor.from_dict(req.kv_region)
    late = create_engine("tcp")
    await late.start()
    try:
        local = late.register(late.allocate(4096))
        with pytest.raises(TransferError, match=r"unknown region"):
            await late.write(local, remote, [(0, 0, 4096)])
    finally:
        await late.stop()


async def test_prefill_worker_says_which_requests_it_has_in_flight(bus):
    async def active(request_id: str) -> bool:
        ask = RequestStatus(request_id=request_id)
        return (await bus.request("tandem.prefill.p2.status", ask, RequestStatusReply)).active

    assert not await active("status-nobody")
    task = asyncio.create_task(generate(bus, "status-1", prompt_ids(600, seed=66), decode="d1",
                                        prefill="p2", max_tokens=2))  # fmt: skip
    seen = False
    for _ in range(400):  # a 600-token prompt is ~10 chunks of 64 tokens on p2
        if seen := await active("status-1"):
            break
        await asyncio.sleep(0.02)
    done = await task
    assert seen and done.error is None and len(done.token_ids) == 2
    assert not await active("status-1")


async def test_a_lost_prefill_reply_fails_the_request_in_seconds_not_at_the_handoff_timeout(bus):
    """A live prefill worker whose PrefillResult never comes (lost in a NATS restart) and
    which says it no longer has the request: the decode worker gives up after two status
    probes --peer-timeout (3 s) apart, not after --handoff-timeout (120 s here), and frees
    the reserved pages. The mute worker is this test: a message cannot be lost on demand."""
    asked: list[str] = []

    async def swallow(msg) -> None:  # takes the PrefillRequest, never replies
        asked.append(PrefillRequest.decode(msg.data).request_id)

    async def status(msg) -> None:
        req = RequestStatus.decode(msg.data)
        await msg.respond(RequestStatusReply(request_id=req.request_id, active=False).encode())

    async def report_load() -> None:
        while True:
            await bus.publish("tandem.workers.prefill.mute.load", LoadReport(
                worker="mute", role="prefill", model_id="m", page_size=16, kv_dtype="float32",
                waiting=0, running=0, waiting_prefill_tokens=0, free_pages=1, total_pages=1,
                tokens_per_s=0.0, max_model_len=1024, timestamp=time.time()))  # fmt: skip
            await asyncio.sleep(0.25)

    subs = [await bus.subscribe("tandem.prefill.mute.prefill", swallow),
            await bus.subscribe("tandem.prefill.mute.status", status)]  # fmt: skip
    reporter = asyncio.create_task(report_load())
    try:
        await asyncio.sleep(0.5)  # d1 has seen the mute worker's load reports
        before = await free_pages(bus, "d1")
        started = time.monotonic()
        done = await generate(bus, "lost-1", prompt_ids(50, seed=65), decode="d1",
                              prefill="mute", max_tokens=4, timeout=60)  # fmt: skip
        took = time.monotonic() - started
        assert asked == ["lost-1"]
        assert done.finish_reason == "error" and "its reply never came" in done.error
        assert took < 20, f"gave up after {took:.1f}s"
        assert await free_pages(bus, "d1", want=before) == before
    finally:
        reporter.cancel()
        for sub in subs:
            await sub.unsubscribe()
