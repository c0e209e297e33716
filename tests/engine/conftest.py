"""Engine fixtures: the default model and the transformers reference, loaded once per session."""

from __future__ import annotations

import pathlib

import pytest
import torch

from libs.common.engine.config import EngineConfig
from libs.common.engine.engine import Engine
from libs.common.engine.load.source import default_model_path, load_model
from libs.common.engine.model.fused_decode import FusedDecode
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.step_loop import EngineCore


@pytest.fixture(scope="session")
def model_and_tokenizer():
    # One thread: the dev machines' 2 cores are shared by parallel test runs, and
    # OpenMP's spinning barriers with 2 threads on oversubscribed cores make each
    # step ~10x slower; 1 thread degrades gracefully.
    torch.set_num_threads(1)
    # The form users get by default: the GGUF's quantized blocks, read by the kernels
    # (test_reference.py holds them to transformers' dequantized fp32 reference).
    loaded, tokenizer = load_model("default", weights="native")
    return LlamaModel(loaded), tokenizer


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


@pytest.fixture
def make_core(model_and_tokenizer):
    """Build an EngineCore over the shared model with a fresh, small KV pool."""
    model, tokenizer = model_and_tokenizer

    def make(**overrides) -> EngineCore:
        settings = {"kv_cache_mb": 96, "max_num_batched_tokens": 2048, "max_num_seqs": 32}
        settings.update(overrides)
        return EngineCore(EngineConfig(**settings), model, tokenizer)

    return make


@pytest.fixture
async def make_engine(model_and_tokenizer):
    """Start async Engines over the shared model (32 MB of KV each); all stopped after."""
    model, tok = model_and_tokenizer
    engines: list[Engine] = []

    async def make(**kw) -> Engine:
        engine = Engine(EngineConfig(kv_cache_mb=32, **kw), model=model, tokenizer=tok)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()
        await engine.stop()  # stop() is idempotent


@pytest.fixture(scope="session")
def reference_model():
    """transformers loading the same GGUF (dequantized, fp32): the correctness reference."""
    transformers = pytest.importorskip("transformers")
    path = pathlib.Path(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def run_to_end(core: EngineCore) -> dict[str, list[int]]:
    """Step until idle; generated ids per request id."""
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def run_with_logprobs(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Step until idle; per request id its generated ids, and their log-probabilities as
    (token id, logprob, top) triples."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    while core.has_work():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            logprobs.setdefault(out.request_id, []).extend(
                (lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs
            )
    return tokens, logprobs


def count_fused_runs(monkeypatch) -> list[tuple[int, bool]]:
    """Wrap FusedDecode.run for the test: the returned list gets, per call, the step's rows
    and whether it took the fused path."""
    calls: list[tuple[int, bool]] = []
    real_run = FusedDecode.run

    def counting_run(self, x, *args):
        used = real_run(self, x, *args)
        calls.append((x.shape[0], used))
        return used

    monkeypatch.setattr(FusedDecode, "run", counting_run)
    return calls
