"""Speculation with a draft model, end to end in the engine: the default model's greedy
tokens are the same with a draft proposing (a tiny random draft, whose drafts it mostly
rejects, and the default model itself, whose drafts it accepts) as without speculation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.spec.draft import DraftModelProposer
from libs.common.engine.step_loop import EngineCore
from libs.common.grammar import build
from tests.engine.conftest import run_to_end
from tests.engine.spec.test_equivalence import PERSON, PERSON_JSON, REPEAT, assert_same
from tests.engine.spec.test_equivalence import generate as run_batch
from tests.engine.spec.tiny_checkpoint import TinyShape, write_tiny_checkpoint

TEXTS = [
    "List the planets of the solar system in order from the sun.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):\n",
    "Write a haiku about a cache miss.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, tokenizer) -> str:
    torch.set_num_threads(1)
    shape = TinyShape(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, seed=3)
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("draft"), shape, tokenizer))


def generate(model_and_tokenizer, **config) -> tuple[dict[str, list[int]], EngineCore]:
    model, tok = model_and_tokenizer
    core = EngineCore(EngineConfig(kv_cache_mb=64, num_threads=1, **config), model, tok)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, text in enumerate(TEXTS):
        core.add(str(i), tok.encode(text), params)
    return run_to_end(core), core


@pytest.fixture(scope="module")
def plain(model_and_tokenizer) -> dict[str, list[int]]:
    return generate(model_and_tokenizer, speculation="off")[0]


def test_greedy_tokens_with_a_random_draft_equal_decoding_without_speculation(
    model_and_tokenizer, tiny_draft, plain
):
    out, core = generate(model_and_tokenizer, speculation="draft", draft_model=tiny_draft)
    assert out == plain
    spec = core.speculator
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    assert spec.num_proposed > 0  # it did verify drafts (and rejected most)
    assert spec.proposer.num_requests == 0  # every finished request released its K/V
    assert spec.proposer.pages.num_free == spec.proposer.pages.num_pages


def test_the_target_as_its_own_draft_has_every_draft_accepted_and_the_same_tokens(
    model_and_tokenizer, plain
):
    out, core = generate(model_and_tokenizer, speculation="draft", draft_model="default")
    assert out == plain
    spec = core.speculator
    assert spec is not None and spec.num_proposed >= NEW_TOKENS
    # the draft's one-token steps and the target's verification of 1 + k positions round
    # differently (~1e-6), which could flip a near-tie: all but a few
    assert spec.num_accepted >= 0.95 * spec.num_proposed


def test_a_draft_model_without_speculation_draft_is_refused_naming_both():
    with pytest.raises(ValueError, match="draft_model and speculation 'draft'"):
        EngineConfig(speculation="ngram", draft_model="default")
    with pytest.raises(ValueError, match="draft_model and speculation 'draft'"):
        EngineConfig(speculation="draft")


def test_cli_draft_model_without_speculation_draft_exits_naming_the_flags():
    cmd = [sys.executable, "-m", "libs.common.engine", "generate", "--prompt", "x",
           "--speculation", "off", "--draft-model", "default", "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "draft_model" in out.stderr


@pytest.mark.slow
def test_cli_with_a_draft_model_prints_the_tokens_of_no_speculation(tiny_draft):
    cmd = [sys.executable, "-m", "libs.common.engine", "generate", "--prompt", TEXTS[1],
           "--max-tokens", "12", "--threads", "1", "--ignore-eos", "--json"]  # fmt: skip
    runs = [subprocess.run(cmd + extra, capture_output=True, text=True, check=True, timeout=240)
            for extra in (["--speculation", "off"], ["--draft-model", tiny_draft])]  # fmt: skip
    off, draft = (json.loads(run.stdout) for run in runs)
    assert draft["token_ids"] == off["token_ids"] and len(off["token_ids"]) == 12


def test_worker_flags_refuse_a_draft_model_without_speculation_draft():
    from libs.common.config import WorkerConfig

    with pytest.raises(ValueError, match="--draft-model"):
        WorkerConfig(draft_model="default")  # speculation stays ngram
    with pytest.raises(ValueError, match="--draft-model"):
        WorkerConfig(speculation="draft")
    assert WorkerConfig(speculation="draft", draft_model="default").draft_model == "default"


@pytest.mark.parametrize("which", ["random", "target"])
def test_grammar_stop_seeded_and_logprobs_with_a_draft_equal_decoding_without_speculation(
    make_core, tokenizer, tiny_draft, which
):
    """As test_equivalence.py's cases (the grammar cuts the draft's tokens it forbids,
    then verification), with the draft model proposing."""
    repeat = tokenizer.encode(REPEAT)
    copy = tokenizer.encode(f"Copy this JSON object exactly.\n{PERSON_JSON}\nCopy:\n")
    requests = {
        "json": (copy, SamplingParams(max_tokens=48, temperature=0.0,
                                      grammar=build.json_schema(PERSON))),
        "stop": (repeat, SamplingParams(max_tokens=40, stop=("oak tree",), temperature=0.0,
                                        logprobs=2)),
        "seeded": (repeat, SamplingParams(max_tokens=16, temperature=0.8, seed=3)),
    }  # fmt: skip
    draft = {"random": tiny_draft, "target": "default"}[which]
    plain, _ = run_batch(make_core, requests, speculation="off", batch=True)
    spec, core = run_batch(make_core, requests, speculation="draft", draft_model=draft, batch=True)
    assert_same(plain, spec)
    assert plain["json"]["end"][0] == "stop" and plain["stop"]["end"][0] == "stop"
    assert core.speculator.num_proposed > 0
    if which == "target":  # greedy drafts all hold; the seeded request's fail where it draws
        assert core.speculator.num_accepted > 0.6 * core.speculator.num_proposed
