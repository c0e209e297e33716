"""Speculative decoding through prefill/decode disaggregation and migration: greedy answers
equal a non-speculating cluster's, token for token, and the decode workers did speculate.

Real processes, twice: a reference cluster whose decode workers run `--speculation off`,
then the cluster under test whose decode workers speculate (the default, n-gram drafts).
Each is nats-server, one prefill worker (p1), two decode workers (d1, d2) and a router
whose prompts above 16 uncached tokens go through p1 (prefix caches and pool off, so every
request is disaggregated: p1 computes the prompt and its first token, a decode worker the
rest). The prompts are input-grounded (bench/grounded.py: the answer quotes the prompt),
so n-gram drafts are accepted; a worker's `info` reports its draft totals. The migration
case kills the decode worker serving a stream once it has sent 8 tokens (as
tests/chaos/test_migration.py does without speculation); the survivor, speculating too,
continues it after exactly the tokens the client has.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from bench import grounded
from tests.chaos.pd_cluster import PdCluster
from tests.chaos.reports import connect, info
from tests.chaos.test_migration import ChunkWatch, Reply, ask
from tests.router.e2e_cluster import WORKER_ARGS, metric

pytestmark = pytest.mark.slow

ROUTER = "router-spec"
DECODERS = ("d1", "d2")
TASKS = grounded.tasks(2, seed=7, kinds=("rewrite", "extract"))


def chat(task: grounded.Task, stream: bool, as_json: bool = False) -> dict:
    body = {"model": "default", "messages": task.messages(as_json), "temperature": 0,
            "max_tokens": 160, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    if as_json:
        body["response_format"] = grounded.response_format()
    else:
        body["ignore_eos"] = True  # long enough to kill a worker in the middle
    return body


REQUESTS = {
    "plain": chat(TASKS[0], stream=False),
    "json_schema": chat(TASKS[1], stream=False, as_json=True),
    "migrated": chat(TASKS[1], stream=True),
}


def cluster_of(workdir, decode_args: tuple[str, ...]) -> PdCluster:
    """The processes above; `decode_args` go to both decode workers."""
    args = (*WORKER_ARGS, "--no-prefix-cache", "true")
    worker_args = {"p1": args, **{d: (*args, *decode_args) for d in DECODERS}}
    return PdCluster(workdir, ROUTER, worker_args)


async def answers(url: str) -> dict[str, Reply]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        return {name: await ask(http, url, "chat/completions", body)
                for name, body in REQUESTS.items()}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Reply]:
    """Every request's answer from a cluster that does not speculate."""
    c = cluster_of(tmp_path_factory.mktemp("spec-off"), ("--speculation", "off"))
    try:
        c.start()
        return asyncio.run(answers(c.url))
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(reference, tmp_path_factory):
    c = cluster_of(tmp_path_factory.mktemp("spec-on"), ())
    try:
        yield c.start()
    finally:
        c.stop()


async def drafts(url: str) -> dict[str, int]:
    """Draft tokens accepted so far by each decode worker (its `info`)."""
    bus = await connect(url, "spec-test")
    try:
        return {d: (await info(bus, "decode", d))["speculation"]["drafts_accepted"]
                for d in DECODERS}  # fmt: skip
    finally:
        await bus.close()


async def speculated(cluster: PdCluster, name: str) -> tuple[Reply, int, float]:
    """The request's answer, the drafts the decode workers accepted meanwhile, and how many
    requests the router sent through the prefill worker meanwhile."""
    before = await drafts(cluster.nats.url)
    routed = await metric(cluster.url, "tandem:router_decisions_total", role="prefill")
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        reply = await ask(http, cluster.url, "chat/completions", REQUESTS[name])
    after = await drafts(cluster.nats.url)
    accepted = sum(after[d] - before[d] for d in DECODERS)
    prefilled = await metric(cluster.url, "tandem:router_decisions_total", role="prefill")
    return reply, accepted, prefilled - routed


def same(got: Reply, want: Reply) -> None:
    assert not got.error and not want.error, (got.error, want.error)
    assert got.text == want.text
    assert got.usage["completion_tokens"] == want.usage["completion_tokens"]


async def test_a_disaggregated_greedy_answer_equals_the_non_speculating_clusters(
    cluster, reference
):
    reply, accepted, prefilled = await speculated(cluster, "plain")
    same(reply, reference["plain"])
    assert prefilled == 1  # disaggregated: p1 computed the prompt
    assert accepted > 0  # the decode worker speculated after the handoff


async def test_a_disaggregated_json_schema_answer_equals_the_non_speculating_clusters(
    cluster, reference
):
    reply, accepted, prefilled = await speculated(cluster, "json_schema")
    same(reply, reference["json_schema"])
    assert set(json.loads(reply.text)) == {"answer"}
    assert prefilled == 1 and accepted > 0


async def test_a_speculating_stream_migrated_mid_generation_equals_the_unmigrated_one(
    cluster, reference
):
    bus = await connect(cluster.nats.url, "spec-migration-test")
    before = await drafts(cluster.nats.url)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            watch = ChunkWatch()
            sub = await bus.subscribe(f"tandem.chunks.{ROUTER}", watch.on_batch)
            call = asyncio.ensure_future(
                ask(http, cluster.url, "chat/completions", REQUESTS["migrated"])
            )
            victim = await watch.serving(8)
            cluster.kill(victim)
            killed_at = time.monotonic()
            moved = await asyncio.wait_for(call, 240)
            await sub.unsubscribe()
    finally:
        await bus.close()
    survivor = next(d for d in DECODERS if d != victim)
    tokens_before_kill = watch.tokens[victim]
    resumed = watch.resumed(victim, killed_at)
    cluster.spawn(victim)  # whole again for whatever runs next
    await cluster.whole()
    after = await drafts(cluster.nats.url)
    same(moved, reference["migrated"])
    assert tokens_before_kill < moved.usage["completion_tokens"]  # killed mid-stream
    assert after[survivor] > before[survivor]  # the continuation speculated too
    print(f"\nspeculating migration: {tokens_before_kill} tokens from {victim}, resumed on "
          f"{survivor} after {resumed:.2f} s")  # fmt: skip
