"""Prefill/decode disaggregation with real workers: outputs equal the engine's own."""

import asyncio

import orjson

from libs.common.bus.connection import RemoteError
from libs.common.messages.control import (
    GenerateRequest,
    InfoRequest,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    ServiceInfo,
)
from tests.workers.conftest import generate, prompt_ids, reference

SHORT, LONG, CHUNKED = prompt_ids(9), prompt_ids(70, seed=1), prompt_ids(150, seed=2)
REPEATED = prompt_ids(150, seed=40)  # no other test shares its first page


async def test_disaggregated_greedy_equals_engine_for_short_long_and_chunked_prompts(bus):
    expected = await reference([SHORT, LONG, CHUNKED], max_tokens=12)
    for i, ids in enumerate([SHORT, LONG, CHUNKED]):
        got = await generate(bus, f"pd-{i}", ids, decode="d1", prefill="p1", max_tokens=12)
        assert got.error is None, got.error
        assert got.token_ids == expected[i]
        assert got.workers == ["d1", "p1"]  # token 0 from prefill, the rest from decode
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 12


async def test_decode_alone_equals_disaggregated(bus):
    alone = await generate(bus, "alone-1", LONG, decode="d2", max_tokens=10)
    split = await generate(bus, "split-1", LONG, decode="d2", prefill="p2", max_tokens=10)
    assert alone.token_ids == split.token_ids and alone.text == split.text
    assert alone.workers == ["d2"]


async def test_sixteen_concurrent_requests_over_two_by_two_workers_are_exact(bus):
    prompts = [prompt_ids(5 + 9 * i, seed=i) for i in range(16)]
    expected = await reference(prompts, max_tokens=8)
    results = await asyncio.gather(
        *(
            generate(
                bus,
                f"many-{i}",
                p,
                decode=f"d{1 + i % 2}",
                prefill=f"p{1 + (i // 2) % 2}",
                max_tokens=8,
                timeout=240,
            )
            for i, p in enumerate(prompts)
        )
    )
    assert [r.error for r in results] == [None] * 16
    assert [r.token_ids for r in results] == expected


async def test_repeated_prefix_reports_cached_tokens_with_equal_output(bus):
    first = await generate(bus, "rep-1", REPEATED, decode="d1", prefill="p2", max_tokens=6)
    second = await generate(bus, "rep-2", REPEATED, decode="d1", prefill="p2", max_tokens=6)
    assert second.token_ids == first.token_ids
    assert first.usage.cached_tokens.get("device", 0) == 0
    # every full page but the last one (at least one token is always computed)
    assert second.usage.cached_tokens["device"] == (len(REPEATED) - 1) // 16 * 16


async def test_prefill_refuses_to_pair_with_a_different_page_size(bus):
    info = await bus.request("tandem.decode.d1.info", InfoRequest(), ServiceInfo)
    req = PrefillRequest(
        request_id="pair-1", token_ids=SHORT, sampling=SamplingSpec(), stream_subject="x",
        decode_worker="d1", kv_region={}, page_indices=[0], skip_pages=0,
        model_id=info.details["model_id"], page_size=32, kv_dtype=info.details["kv_dtype"],
        kv_num_pages=10,
    )  # fmt: skip
    try:
        await bus.request("tandem.prefill.p1.prefill", req, PrefillResult)
        raise AssertionError("pairing with another page size must be refused")
    except RemoteError as e:
        assert e.code == 409 and "page size" in e.message


async def test_bad_generate_requests_get_error_replies_and_worker_keeps_serving(bus):
    raw = await bus.nc.request("tandem.decode.d2.generate", b"{nope", timeout=5)
    assert raw.headers["Nats-Service-Error-Code"] == "400"
    # SamplingSpec refuses the value when built: the bad field goes in as raw JSON.
    good = GenerateRequest(
        request_id="bad-1", token_ids=SHORT, sampling=SamplingSpec(), stream_subject="x"
    )
    bad = orjson.loads(good.encode())
    bad["sampling"]["temperature"] = -1
    raw = await bus.nc.request("tandem.decode.d2.generate", orjson.dumps(bad), timeout=5)
    assert raw.headers["Nats-Service-Error-Code"] == "400"
    assert "temperature" in raw.headers.get("Nats-Service-Error", "") + raw.data.decode()
    ok = await generate(bus, "after-bad", SHORT, decode="d2", max_tokens=3)
    assert ok.error is None and len(ok.token_ids) == 3


async def test_info_shows_transport_and_pairing_facts(bus):
    info = await bus.request("tandem.prefill.p1.info", InfoRequest(), ServiceInfo)
    assert info.details["transport"] == "tcp" and info.details["page_size"] == 16
    assert info.details["kv_dtype"] == "float32/native" and info.details["model_id"]
    orjson.dumps(info.details)  # plain data


async def test_decode_worker_reuses_its_cached_prefix_and_receives_only_the_suffix(bus):
    prompt = prompt_ids(90, seed=41)  # 5 full pages before the last token
    first = await generate(bus, "held-1", prompt, decode="d2", prefill="p1", max_tokens=5)
    again = await generate(bus, "held-2", prompt, decode="d2", prefill="p2", max_tokens=5)
    assert first.accepted.num_held_pages == 0
    assert again.accepted.num_held_pages == (len(prompt) - 1) // 16
    assert again.token_ids == first.token_ids and again.error is None


async def test_both_worker_prefills_for_a_decode_worker_and_serves_alone(bus):
    info = await bus.request("tandem.decode.d2.info", InfoRequest(), ServiceInfo)
    assert info.details["role"] == "both"
    prompt = prompt_ids(60, seed=42)
    expected = (await reference([prompt], max_tokens=8))[0]
    split = await generate(bus, "both-1", prompt, decode="d1", prefill="d2", max_tokens=8)
    alone = await generate(bus, "both-2", prompt_ids(60, seed=43), decode="d2", max_tokens=8)
    assert split.error is None and split.token_ids == expected
    assert split.workers == ["d1", "d2"]  # token 0 from d2 as a prefill worker
    assert alone.error is None and alone.workers == ["d2"] and len(alone.token_ids) == 8
