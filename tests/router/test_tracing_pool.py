"""The KV pool in a request's trace: pages written to it (`pool.put`) and read back from
it (`pool.get`), each in the one trace of the request they serve.

Real processes, as in test_tracing_cluster.py: nats-server, a cache_master and a
cache_store, a prefill worker p1 and a decode worker d1 (default model, tcp) and a
router, all exporting to this test's OTLP receiver. Request A is disaggregated (its
uncached prompt is over --disagg-threshold): p1 asks the pool (empty), computes the
prompt and writes its pages; d1 writes the pages of prompt and answer after the last
token. d1 is then restarted (an empty cache) and request B, the same prompt, goes to it
alone (the pool covers all but the last page: below the threshold): d1 reads the pages
back from the pool.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import nats
import pytest

from libs.common.messages.control import InfoRequest, ServiceInfo
from libs.common.messages.pool import PoolStats
from scripts.cluster import LocalCluster
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import wait_healthy
from tests.router.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.router.trace_requests import chat_stream, fresh_prompt, root_span

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUTER = "router-trace-pool"
WORKER_ARGS = ("--num-threads", "1", "--kv-cache-mb", "128", "--transport", "tcp")
PAGE = 16  # tokens a page
PAGE_BYTES = 720 * 1024  # one page object: the default model's fp32 KV (test_router_pins.py)


@dataclass
class Cluster:
    local: LocalCluster
    url: str
    nats_url: str


@dataclass
class Traced:
    """A request's trace, once every span named in `wanted` is in."""

    label: str
    spans: list[ReceivedSpan]

    def one(self, name: str, service: str = "") -> ReceivedSpan:
        found = [s for s in self.spans if s.name == name and service in s.service]
        assert len(found) == 1, (name, service, found)
        return found[0]

    def children(self, parent: ReceivedSpan) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.parent_id == parent.span_id]


@pytest.fixture(scope="module")
def cluster(module_nats, tmp_path_factory, receiver):
    # every service traces; spans leave in batches every 100 ms (the SDK's variable)
    env = {**router_env(), "TANDEM_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    local = LocalCluster(module_nats.url, env=env, capture=tmp_path_factory.mktemp("pool-trace"))
    try:
        local.start_one("cache_master", "--service-id", "m1", "--election", "false")
        local.start_one("cache_store", "--service-id", "s1", "--segment-size", "64MiB",
                        "--transport", "tcp")  # fmt: skip
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            local.start_one(role, "--service-id", sid, *WORKER_ARGS, label=sid)
        local.start_one("router", "--service-id", ROUTER, "--port", "0",
                        "--disagg-threshold", "32")  # fmt: skip
        url = f"http://127.0.0.1:{asyncio.run(router_port(module_nats.url, ROUTER, 240))}"
        asyncio.run(wait_healthy(url, {"prefill": 1, "decode": 1}, 240, local.procs))
        asyncio.run(_store_mounted(module_nats.url))
        yield Cluster(local, url, module_nats.url)
    finally:
        local.stop()


async def _store_mounted(nats_url: str, timeout: float = 60.0) -> None:
    nc = await nats.connect(nats_url)
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await nc.request("tandem.pool.master.stats", InfoRequest().encode(), 5)
                if PoolStats.decode(msg.data).stores:
                    return
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def _traced(receiver: OtlpReceiver, url: str, label: str, prompt: str,
                  wanted: dict[str, int]) -> Traced:  # fmt: skip
    """Send a request; its trace once it holds `wanted` (span name -> how many)."""
    _, _, data = await chat_stream(url, label, prompt)
    assert data.rstrip().endswith(b"data: [DONE]")
    assert await receiver.wait_for(lambda: root_span(receiver, label) is not None)
    trace_id = root_span(receiver, label).trace_id

    def complete() -> bool:  # and one tree: every span's parent is in (ended, exported)
        spans = receiver.trace(trace_id)
        names, ids = [s.name for s in spans], {s.span_id for s in spans}
        counted = all(names.count(name) >= n for name, n in wanted.items())
        return counted and all(s.parent_id in ids for s in spans if s.parent_id)

    found = await receiver.wait_for(complete)
    assert found, sorted((s.service, s.name, s.span_id, s.parent_id)
                         for s in receiver.trace(trace_id))  # fmt: skip
    assert receiver.bad_requests == 0
    return Traced(label, receiver.trace(trace_id))


def _show(traced: Traced) -> None:
    """The trace, span by span (`pytest -s`): what docs/operations.md describes."""
    start = min(s.start_ns for s in traced.spans)
    print(f"\n{traced.label}:")
    for s in sorted(traced.spans, key=lambda s: s.start_ns):
        pages = {k[7:]: v for k, v in s.attributes.items() if "pages" in k or k == "tandem.bytes"}
        print(f"  {s.service:20} {s.name:24} +{(s.start_ns - start) / 1e6:8.2f} "
              f"{(s.end_ns - s.start_ns) / 1e6:8.2f} ms {pages or ''}")  # fmt: skip


def _within(inner: ReceivedSpan, outer: ReceivedSpan) -> bool:
    return outer.start_ns <= inner.start_ns and inner.end_ns <= outer.end_ns


def _pool_calls(traced: Traced, span: ReceivedSpan) -> set[tuple[str, str]]:
    """What this pool span asked of the pool, the master and (through it) the stores, as
    (service, span): server spans below it in the same trace, inside its time."""
    below, todo = [], traced.children(span)
    while todo:
        below += todo
        todo = [c for s in todo for c in traced.children(s)]
    assert all(_within(s, span) for s in below)
    return {(s.service.removeprefix("tandem-"), s.name) for s in below}


@pytest.fixture(scope="module")
def written(cluster, receiver) -> tuple[str, Traced]:
    """Request A (disaggregated), once its pool writes are in its trace: (prompt, trace)."""
    prompt = fresh_prompt()
    label = f"pool-put-{uuid.uuid4().hex[:12]}"
    wanted = {"pool.get": 1, "pool.put": 2, "decode.tokens": 1}
    return prompt, asyncio.run(_traced(receiver, cluster.url, label, prompt, wanted))


def test_a_prompts_pages_go_to_the_pool_inside_the_trace_of_the_request_that_computed_them(
    written,
):
    _, a = written
    _show(a)
    assert a.one("router.route").attributes["tandem.reason"] == "disaggregated"
    prefill, request = a.one("prefill", "prefill"), a.one("decode.request", "decode")
    prompt_tokens = request.attributes["tandem.prompt_tokens"]
    # d1's queue: from the KV in place to its first step, where its decoding begins
    queue, tokens = a.one("decode.queue"), a.one("decode.tokens")
    assert a.one("kv.handoff").end_ns <= queue.start_ns and queue.end_ns == tokens.start_ns
    # p1 asks the pool for the prompt's pages before computing it: none there yet
    get = a.one("pool.get")
    assert get.service == "tandem-prefill" and get.parent_id == prefill.span_id
    assert _within(get, prefill)
    assert get.attributes["tandem.pages"] == (prompt_tokens - 1) // PAGE
    assert get.attributes["tandem.pages_read"] == 0 and get.attributes["tandem.bytes"] == 0
    assert _pool_calls(a, get) == {("cache_master", "exists")}
    # ... and writes its full pages once computed: queued inside `prefill`, ending after it
    # is allowed (off the critical path); d1 writes prompt and answer after the last token
    puts = {s.service.removeprefix("tandem-"): s for s in a.spans if s.name == "pool.put"}
    assert set(puts) == {"prefill", "decode"}
    assert puts["prefill"].parent_id == prefill.span_id
    assert prefill.start_ns <= puts["prefill"].start_ns <= prefill.end_ns
    assert puts["decode"].parent_id == request.span_id
    assert tokens.end_ns <= puts["decode"].start_ns <= request.end_ns
    answered = prompt_tokens + tokens.attributes["tandem.completion_tokens"] - 1  # KV'd tokens
    pages = {"prefill": prompt_tokens // PAGE, "decode": answered // PAGE}
    stored = {k: s.attributes["tandem.pages_written"] for k, s in puts.items()}
    for k, put in puts.items():
        assert put.attributes["tandem.pages"] == pages[k]
        assert put.attributes["tandem.bytes"] == stored[k] * PAGE_BYTES
    # each page once, whichever of the two (running at once) the master took it from
    assert 0 < stored["prefill"] <= pages["prefill"]
    assert stored["prefill"] + stored["decode"] == pages["decode"]
    assert _pool_calls(a, puts["prefill"]) == {
        ("cache_master", "exists"), ("cache_master", "put_start"), ("cache_store", "grant"),
        ("cache_master", "put_end")}  # fmt: skip


async def _restart(cluster: Cluster, sid: str, role: str) -> None:
    """Stop worker `sid` (SIGTERM: its spans leave) and start it again, empty; return
    once the new process answers (its endpoints, generate with them, are up)."""
    proc = cluster.local.procs[sid]
    proc.terminate()
    await asyncio.to_thread(proc.wait, 60)
    since = time.time()
    cluster.local.start_one(role, "--service-id", sid, *WORKER_ARGS, label=sid)
    nc = await nats.connect(cluster.nats_url)
    try:
        async with asyncio.timeout(240):
            while True:
                try:
                    msg = await nc.request(f"tandem.{role}.{sid}.info", InfoRequest().encode(), 1)
                    if ServiceInfo.decode(msg.data).started_at >= since:
                        break
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    pass
                assert cluster.local.procs[sid].poll() is None, f"{sid} exited"
                await asyncio.sleep(0.5)
    finally:
        await nc.close()
    await wait_healthy(cluster.url, {"prefill": 1, "decode": 1}, 60, cluster.local.procs)


async def test_a_worker_without_the_pages_reads_them_from_the_pool_inside_the_requests_trace(
    cluster, receiver, written
):
    prompt, _ = written
    await _restart(cluster, "d1", "decode")
    label = f"pool-get-{uuid.uuid4().hex[:12]}"
    b = await _traced(receiver, cluster.url, label, prompt, {"pool.get": 1, "decode.tokens": 1})
    _show(b)
    route = b.one("router.route")
    assert route.attributes["tandem.reason"] == "below_threshold"
    assert (route.attributes["tandem.decode"], route.attributes["tandem.prefill"]) == ("d1", "")
    request = b.one("decode.request", "decode")
    pages = (request.attributes["tandem.prompt_tokens"] - 1) // PAGE
    get = b.one("pool.get")
    assert get.service == "tandem-decode" and get.parent_id == request.span_id
    assert _within(get, request)
    assert get.end_ns <= b.one("decode.queue").start_ns  # read before the prompt queues
    assert get.attributes["tandem.pages"] == pages
    assert get.attributes["tandem.pages_read"] == pages  # every page, from the pool
    assert get.attributes["tandem.bytes"] == pages * PAGE_BYTES
    assert _pool_calls(b, get) == {("cache_master", "exists"), ("cache_master", "get"),
                                   ("cache_store", "grant")}  # fmt: skip
    assert b.one("decode.prefill")  # the last, partial page computed here
