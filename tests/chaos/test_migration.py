"""Migration exact: kill -9 the decode worker serving a request mid-generation; the client
sees one uninterrupted response, equal to an uninterrupted run of the same request.

Real processes: nats-server, one prefill worker (p1), two decode workers (d1, d2) and a
router whose prompts above 16 uncached tokens go through p1, so a request starts
disaggregated and its continuation is prefilled by the surviving decode worker itself. The
test watches the router's chunk subject to see which decode worker serves the request and
kills that one once it has streamed some tokens. The case with no other decode worker
live (the client gets an error, as before migration) is tests/router/test_worker_death.py.
Figures (time to resume) are printed; docs/reliability.md "Migration" has them.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest

from libs.common.messages.control import TokenChunkBatch
from tests.chaos.pd_cluster import PdCluster
from tests.chaos.reports import connect

pytestmark = pytest.mark.slow

ROUTER = "router-mig"
STORY = "Write a long story about a lighthouse keeper and the ships she saw over forty years."
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "maxItems": 4,
        },
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = PdCluster(tmp_path_factory.mktemp("migration"), ROUTER)
    try:
        yield c.start()
    finally:
        c.stop()


@dataclass
class Reply:
    """What the client got: the text, usage, an error, and when each SSE event came."""

    text: str = ""
    usage: dict = field(default_factory=dict)
    error: str = ""
    arrivals: list[float] = field(default_factory=list)


async def ask(http: aiohttp.ClientSession, url: str, endpoint: str, body: dict) -> Reply:
    out = Reply()
    async with http.post(f"{url}/v1/{endpoint}", json=body) as r:
        if not body.get("stream"):
            data = await r.json(content_type=None)
            if r.status != 200:
                return Reply(error=str(data))
            choice = data["choices"][0]
            out.text = choice.get("text") or choice["message"]["content"]
            out.usage = data["usage"]
            return out
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            out.arrivals.append(time.monotonic())
            if "error" in event:
                out.error = str(event["error"])
            for choice in event.get("choices", []):
                out.text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            out.usage = event.get("usage") or out.usage
    return out


class ChunkWatch:
    """Tokens per decode worker on the router's chunk subject, with their arrival times."""

    def __init__(self):
        self.tokens: collections.Counter[str] = collections.Counter()
        self.seen: list[tuple[float, str]] = []

    async def on_batch(self, msg) -> None:
        batch = TokenChunkBatch.decode(msg.data)
        n = sum(len(c.token_ids) for c in batch.chunks)
        self.tokens[batch.worker] += n
        if n:
            self.seen.append((time.monotonic(), batch.worker))

    async def serving(self, n: int, timeout: float = 60) -> str:
        async with asyncio.timeout(timeout):
            while True:
                for worker, count in self.tokens.items():
                    if count >= n:
                        return worker
                await asyncio.sleep(0.02)

    def resumed(self, victim: str, since: float) -> float:
        """Seconds from `since` to the first tokens from another worker than `victim`."""
        return next(t for t, w in self.seen if w != victim and t > since) - since


async def migrated(cluster: PdCluster, endpoint: str, body: dict) -> tuple[Reply, Reply, dict]:
    """The request run whole, then again with its decode worker killed after 8 tokens:
    (uninterrupted reply, migrated reply, figures)."""
    bus = await connect(cluster.nats.url, "migration-test")
    timeout = aiohttp.ClientTimeout(total=180)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            t0 = time.monotonic()
            whole = await ask(http, cluster.url, endpoint, body)
            took = time.monotonic() - t0
            watch = ChunkWatch()
            sub = await bus.subscribe(f"tandem.chunks.{ROUTER}", watch.on_batch)
            t0 = time.monotonic()
            call = asyncio.ensure_future(ask(http, cluster.url, endpoint, body))
            victim = await watch.serving(8)
            cluster.kill(victim)
            killed_at = time.monotonic()
            moved = await asyncio.wait_for(call, 120)
            figures = {
                "victim": victim,
                "tokens_before_kill": watch.tokens[victim],
                "resumed_s": round(watch.resumed(victim, killed_at), 2),
                "whole_s": round(took, 2),
                "migrated_s": round(time.monotonic() - t0, 2),
            }
            await sub.unsubscribe()
    finally:
        await bus.close()
    if moved.arrivals:  # the longest silence the streaming client saw
        gaps = [b - a for a, b in zip(moved.arrivals, moved.arrivals[1:], strict=False)]
        figures["client_gap_s"] = round(max(gaps), 2)
    cluster.spawn(victim)  # back for the next test
    await cluster.whole()
    return whole, moved, figures


def completion(stream: bool, **extra) -> dict:
    return {"model": "default", "prompt": STORY, "max_tokens": 96, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}  # fmt: skip


def check_same(whole: Reply, moved: Reply, figures: dict) -> None:
    assert not whole.error and not moved.error, (whole.error, moved.error)
    assert moved.text == whole.text, figures
    assert moved.usage["completion_tokens"] == whole.usage["completion_tokens"]
    assert moved.usage["prompt_tokens"] == whole.usage["prompt_tokens"]
    assert figures["tokens_before_kill"] < whole.usage["completion_tokens"]  # mid-stream
    print(f"\nmigration: {figures}")


async def test_a_greedy_stream_survives_its_decode_worker_token_for_token(cluster):
    body = completion(True, stream_options={"include_usage": True})
    whole, moved, figures = await migrated(cluster, "completions", body)
    check_same(whole, moved, figures)
    assert figures["resumed_s"] < 8


async def test_a_greedy_whole_response_survives_its_decode_worker(cluster):
    whole, moved, figures = await migrated(cluster, "completions", completion(False))
    check_same(whole, moved, figures)


async def test_a_json_schema_stream_is_migrated_through_its_grammar_and_stays_valid(cluster):
    body = {"model": "default", "stream": True, "temperature": 0, "max_tokens": 160,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": PERSON}},
            "stream_options": {"include_usage": True}}  # fmt: skip
    whole, moved, figures = await migrated(cluster, "chat/completions", body)
    check_same(whole, moved, figures)
    person = json.loads(moved.text)
    assert set(person) == {"name", "age", "hobbies"}


async def test_a_regex_request_is_migrated_and_still_matches(cluster):
    pattern = r"(\d+, ){24}\d+\."
    body = completion(False, regex=pattern, max_tokens=120, ignore_eos=False,
                      prompt="Count from 1 to 25, separated by commas: ")  # fmt: skip
    whole, moved, figures = await migrated(cluster, "completions", body)
    check_same(whole, moved, figures)
    assert re.fullmatch(pattern, moved.text), moved.text
