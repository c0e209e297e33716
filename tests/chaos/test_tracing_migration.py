"""A request whose decode worker dies mid-stream stays one trace: the router's first
attempt, the migration's attempt, and the surviving worker's continuation, in one tree.

Real processes (tests/chaos/pd_cluster.py: p1, d1, d2, a router), each exporting to the
OTLP/HTTP receiver of this test (tests/router/otlp_receiver.py); the decode worker serving
the stream is killed (-9, by its pid) after 8 tokens. Its own unsent spans die with it.
"""

from __future__ import annotations

import asyncio
import collections
import uuid

import aiohttp
import pytest

from libs.common.messages.control import TokenChunkBatch
from tests.chaos.pd_cluster import PdCluster
from tests.chaos.reports import connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUTER = "router-trace-mig"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, receiver):
    c = PdCluster(tmp_path_factory.mktemp("trace-migration"), ROUTER)
    c.local.env.update(TANDEM_OTLP_ENDPOINT=receiver.url, OTEL_BSP_SCHEDULE_DELAY="100")
    try:
        yield c.start()
    finally:
        c.stop()


async def _serving(tokens: collections.Counter, n: int) -> str:
    async with asyncio.timeout(60):
        while True:
            for worker, count in tokens.items():
                if count >= n:
                    return worker
            await asyncio.sleep(0.02)


async def test_a_migrated_request_is_one_trace_with_both_attempts(cluster, receiver):
    label = f"mig-{uuid.uuid4().hex[:12]}"
    prompt = f"{label}: a long story about a lighthouse keeper."
    body = {"model": "default", "max_tokens": 96, "temperature": 0, "ignore_eos": True,
            "stream": True, "prompt": prompt}  # fmt: skip
    tokens: collections.Counter[str] = collections.Counter()

    async def on_batch(msg) -> None:
        batch = TokenChunkBatch.decode(msg.data)
        tokens[batch.worker] += sum(len(c.token_ids) for c in batch.chunks)

    bus = await connect(cluster.nats.url, "trace-migration-test")
    sub = await bus.subscribe(f"tandem.chunks.{ROUTER}", on_batch)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
            post = http.post(f"{cluster.url}/v1/completions", json=body,
                             headers={"x-request-id": label})  # fmt: skip
            async with post as r:
                assert r.status == 200
                read = asyncio.ensure_future(r.read())
                victim = await _serving(tokens, 8)
                cluster.kill(victim)
                data = await asyncio.wait_for(read, 120)
        assert b'"error"' not in data and data.rstrip().endswith(b"data: [DONE]")
    finally:
        await sub.unsubscribe()
        await bus.close()
    cluster.spawn(victim)  # back for whoever comes next

    def spans(name: str) -> list:
        return [s for s in list(receiver.spans) if s.name == name]

    def roots() -> list:
        return [s for s in spans("POST /v1/completions")
                if s.attributes.get("tandem.request_id") == label]  # fmt: skip

    def done() -> bool:  # the survivor's last span and the router's root (which ends last,
        # after its attempts: each process exports in its own batches) are in
        return bool(roots()) and any(s.attributes.get("tandem.continued_after", 0) > 0
                                     for s in spans("decode.request"))  # fmt: skip

    assert await receiver.wait_for(done)
    root = roots()[0]
    trace = receiver.trace(root.trace_id)
    attempts = sorted((s for s in trace if s.name == "router.attempt"), key=lambda s: s.start_ns)
    assert len(attempts) >= 2
    assert attempts[0].attributes["tandem.decode"] == victim
    assert attempts[0].attributes["tandem.continued_after"] == 0
    assert attempts[-1].attributes["tandem.decode"] != victim
    assert attempts[-1].attributes["tandem.continued_after"] >= 8  # what the client had
    survivor = [s for s in trace if s.name == "decode.request" and s.service == "tandem-decode"]
    assert any(s.attributes["tandem.continued_after"] >= 8 for s in survivor)
    # the survivor computed prompt + the tokens already sent itself
    assert [s for s in trace if s.name == "decode.prefill"]
    await cluster.whole()
