"""The AVX2 build of the kernels (forced with TANDEM_KERNELS, so it runs on AVX-512 hosts
too) against transformers on the default GGUF: the same greedy tokens, with decode batches
of 8 rows (the 256-bit int16 panels), of 1 row (the fused decode layer) and prefills."""

from __future__ import annotations

import pytest
import torch

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.source import load_model
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.model.quant.native import VARIANTS, cpu_flags, library
from libs.common.engine.step_loop import EngineCore
from tests.engine.conftest import run_to_end
from tests.engine.test_reference import CHAT, RAW

pytestmark = pytest.mark.slow
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def avx2_model():
    """The default model built while TANDEM_KERNELS=avx2: every product and kernel of the
    module's steps runs the AVX2 build."""
    if not VARIANTS["avx2"][1] <= cpu_flags():
        pytest.skip("this CPU cannot run the avx2 build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_KERNELS", "avx2")
        torch.set_num_threads(1)
        assert library()[0].tq_panel_products() == 3  # int16-panels-256
        loaded, tokenizer = load_model("default", weights="native")
        yield LlamaModel(loaded), tokenizer


def greedy(avx2_model, prompts: list[list[int]]) -> list[list[int]]:
    model, tokenizer = avx2_model
    # The build's own kernels at every batch size: a measured choice may hand >128-row
    # prefills to oneDNN when it times faster (test_product_choice.py checks each forced
    # path against the reference, with its tolerance for numerical ties)
    core = EngineCore(EngineConfig(kv_cache_mb=96, kernel_choice="native"), model, tokenizer)
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        core.add(str(i), ids, params)
    out = run_to_end(core)
    return [out[str(i)] for i in range(len(prompts))]


def reference_greedy_ok(reference_model, ids: list[int], gen: list[int]) -> None:
    """Each of our tokens is the reference's argmax given the tokens before it (teacher
    forcing): our greedy ids equal the reference's greedy decoding."""
    with torch.no_grad():
        logits = reference_model(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1]
    assert gen == logits.argmax(-1).tolist()


def test_avx2_build_greedy_tokens_equal_the_reference(avx2_model, reference_model):
    _, tokenizer = avx2_model
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    prompts = [tokenizer.encode(p) for p in RAW + chat]
    batched = greedy(avx2_model, prompts)  # 8 decode rows a step: the 256-bit panels
    for ids, gen in zip(prompts, batched, strict=True):
        assert len(gen) == NEW_TOKENS
        reference_greedy_ok(reference_model, ids, gen)
    assert greedy(avx2_model, prompts[:1]) == batched[:1]  # alone: tq_gemv, fused layer
