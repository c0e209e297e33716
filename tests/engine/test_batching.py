"""Greedy outputs do not depend on how requests are batched, chunked, cached or preempted."""

from __future__ import annotations

import pytest

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.model.quant.native import library
from tests.engine.conftest import run_to_end, run_with_logprobs

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LENGTHS = [5, 9, 17, 24, 31, 40, 47, 56, 64, 77, 90, 101, 115, 128, 150, 181]


@pytest.fixture(scope="module")
def prompts(model_and_tokenizer):
    _, tok = model_and_tokenizer
    text = (
        "Tandem serves large language models with prefill and decode on separate workers "
        "and a distributed KV-cache pool shared by all of them. It is a set of asyncio "
        "microservices in Python. The control plane is NATS; bulk KV bytes never cross NATS. "
    ) * 4
    ids = tok.encode(text)
    # Different starts so the prompts are not prefixes of each other.
    return [ids[i % 7 : i % 7 + n] for i, n in enumerate(LENGTHS)]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _run(core, prompts) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        core.add(str(i), ids, _params())
    out = run_to_end(core)
    return [out[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def alone(prompts, model_and_tokenizer):
    """Each prompt alone, unchunked, no prefix cache."""
    from libs.common.engine.config import EngineConfig
    from libs.common.engine.step_loop import EngineCore

    model, tok = model_and_tokenizer
    core = EngineCore(EngineConfig(kv_cache_mb=64, enable_prefix_cache=False), model, tok)
    return [_run(core, [ids])[0] for ids in prompts]


def test_16_mixed_length_requests_batched_equal_each_alone(make_core, prompts, alone):
    assert _run(make_core(enable_prefix_cache=False), prompts) == alone


@pytest.mark.parametrize("chunk", [16, 37, 64])
def test_chunked_prefill_equals_unchunked(make_core, prompts, alone, chunk):
    core = make_core(max_num_batched_tokens=chunk, max_num_seqs=min(chunk, 16))
    picked = [0, 9, 13, 15]
    assert _run(core, [prompts[i] for i in picked]) == [alone[i] for i in picked]


def test_prefix_cache_hits_give_the_same_tokens_as_cold(make_core, prompts, alone):
    core = make_core()
    base = prompts[15]
    assert _run(core, [base]) == [alone[15]]
    # The same prompt again, and a prompt sharing its first pages: both hit.
    longer = base[:100] + prompts[14][:40]
    for i, ids in enumerate([base, longer]):
        core.add(f"hit{i}", ids, _params())
        seq = core.scheduler.get(f"hit{i}")
        out = run_to_end(core)[f"hit{i}"]
        assert seq.num_cached_tokens >= 96, "expected a prefix-cache hit"
        cold = make_core(enable_prefix_cache=False)
        assert out == _run(cold, [ids])[0]


def test_preempted_requests_give_the_same_tokens(make_core, prompts, alone):
    picked = [10, 11, 12, 13]
    # 32 pages of 16 tokens cannot hold four ~100-token prompts growing by 12. Without
    # speculation: its runs finish some requests sooner and the pool pressure never comes.
    core = make_core(num_pages=30, enable_prefix_cache=False, speculation="off")
    for i in picked:
        core.add(str(i), prompts[i], _params())
    seqs = [core.scheduler.get(str(i)) for i in picked]
    out = run_to_end(core)
    assert sum(s.num_preemptions for s in seqs) > 0, "the pool was meant to force a preemption"
    assert [out[str(i)] for i in picked] == [alone[i] for i in picked]


def test_a_stream_scores_the_same_bits_alone_beside_others_and_from_the_cache(make_core, prompts):
    """Where int16 panels multiply (AVX2, AVX-512 builds) a row's product has the same bits
    in any batch, 1 row to a prefill of thousands (quant/x16_products.h), so a greedy
    stream's log-probabilities, not only its tokens, are the same whatever shares its
    steps, with its prompt computed cold or found in the prefix cache: a near-tie between
    two tokens resolves alike under any load."""
    if not library()[0].tq_panel_products():
        pytest.skip("this build multiplies 1-4 rows and batches by different summations")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)

    def scores(core, batch: list[list[int]], rid: str) -> list:
        core.add(rid, batch[0], params)
        for i, ids in enumerate(batch[1:]):
            core.add(f"{rid}-other{i}", ids, params)
        return run_with_logprobs(core)[1][rid]

    target = prompts[9]  # 90 tokens
    native = {"kernel_choice": "native"}
    alone = scores(make_core(enable_prefix_cache=False, speculation="off", **native), [target], "a")
    beside = scores(make_core(enable_prefix_cache=False, **native), [target, *prompts[:6]], "b")
    assert len(alone) == NEW_TOKENS and beside == alone
    core = make_core(**native)
    assert scores(core, [target], "cold") == alone
    core.add("hit", target, params)
    seq = core.scheduler.get("hit")
    cached = run_with_logprobs(core)[1]["hit"]
    assert seq.num_cached_tokens >= 64, "expected a prefix-cache hit"
    assert cached == alone
