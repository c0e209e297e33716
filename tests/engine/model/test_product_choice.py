"""The product chosen per weight shape and row class at start-up (model/kernel_choice.py):
made and logged once, cached, and every path it can choose gives the reference's tokens."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.source import load_model
from libs.common.engine.model.kernel_choice import choose_kernels, key_of, quant_linears
from libs.common.engine.model.linear import ROW_CLASSES, QuantLinear, row_class
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.model.quant.native import VARIANTS, cpu_flags, library
from tests.engine.conftest import run_to_end

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1969, the first humans",
    "Water boils at a temperature of",
    "What is the capital of France? Explain in one sentence.",
    "Write a haiku about the sea.",
]
NEW_TOKENS = 16
TIE = 1e-4  # a top-2 logit gap under which a flip is a numerical tie (test_reference.py)


@pytest.fixture
def model(model_and_tokenizer):
    """The shared model; its products go back to the native paths after the test."""
    model = model_and_tokenizer[0]
    yield model
    choose_kernels(model, "native")


def force(model, path: str) -> None:
    """Route 5+ row classes of every quantized weight through `path` where it can run
    them ("native": the built-in paths)."""
    for linear in quant_linears(model):
        chosen = list(linear.native_paths)
        for cls in (1, 2):
            if path != "native" and path in linear.candidates(cls):
                chosen[cls] = path
        linear.use(tuple(chosen))


def test_row_classes_split_at_the_gemv_and_gemm_bounds():
    assert [row_class(n) for n in (1, 4, 5, 128, 129, 4096)] == [0, 0, 1, 1, 2, 2]
    assert (QuantLinear.GEMV_ROWS, QuantLinear.GEMM_ROWS) == (4, 128)


def test_every_path_gives_a_row_the_same_bits_in_any_batch_of_its_class(model):
    """So a choice per class keeps a row's result independent of the rows beside it (a
    chunked prefill's rows equal the unchunked ones), whichever path is chosen."""
    gen = torch.Generator().manual_seed(3)
    for linear in (model.layers[0].qkv, model.layers[0].mlp.down):
        copy = linear.make_copy()
        for cls, sizes in ((1, (5, 17, 128)), (2, (129, 300))):
            x = torch.randn(max(sizes), linear.in_features, generator=gen)
            native = linear.product(linear.native_paths[cls], x)
            for path in linear.candidates(cls):
                full = linear.product(path, x, copy)
                for n in sizes:
                    part = linear.product(path, x[-n:].contiguous(), copy)
                    assert torch.equal(part, full[-n:]), (path, ROW_CLASSES[cls], n)
                # one function: x rounded alike, only the summation order differs
                assert float((full - native).abs().max() / native.abs().max()) < 1e-5


def test_the_choice_is_measured_once_per_shape_and_class_and_logged(model):
    with capture_logs() as logs:
        table = choose_kernels(model, "measure", copy_mb=0)
    keys = {key_of(q) for q in quant_linears(model)}
    assert set(table) == keys and len(keys) >= 5  # lm_head, q|k|v, o, gate|up, down
    lines = [e for e in logs if e["event"] == "quant.choice"]
    assert len(lines) == len(keys) * len(ROW_CLASSES)
    for line in lines:
        linear = next(
            q for q in quant_linears(model) if key_of(q) == (line["format"], *line["shape"])
        )
        cls = ROW_CLASSES.index(line["rows"])
        assert line["chosen"] == linear.paths[cls] == table[key_of(linear)][cls]
        assert line["chosen"] in linear.candidates(cls)
        if cls:  # 5+ rows: every candidate timed; a copy only when memory was granted
            assert set(line["candidates_ms"]) == set(linear.candidates(cls))
            assert all(t > 0 for t in line["candidates_ms"].values())
            assert line["chosen"] != "copy"
        else:
            assert line["chosen"] == "gemv"
    done = next(e for e in logs if e["event"] == "quant.choice_done")
    assert done["copies_mb"] == 0
    with capture_logs() as again:  # cached for the process: the same table, nothing timed
        assert choose_kernels(model, "measure", copy_mb=0) == table
    assert next(e for e in again if e["event"] == "quant.choice_done")["seconds"] < 0.1


def test_fp32_copies_stay_within_their_memory_budget(model):
    budget_mb = 48
    table = choose_kernels(model, "measure", copy_mb=budget_mb)
    copied = [q for q in quant_linears(model) if "copy" in table[key_of(q)]]
    assert sum(4 * q.out_features * q.in_features for q in copied) <= budget_mb << 20
    assert all(q._copy is not None for q in copied)
    choose_kernels(model, "native")
    assert all(q.paths == q.native_paths and q._copy is None for q in quant_linears(model))


def test_the_engine_config_refuses_unknown_choices():
    with pytest.raises(ValueError, match="kernel_choice"):
        EngineConfig(kernel_choice="fastest")
    with pytest.raises(ValueError, match="kernel_copy_mb"):
        EngineConfig(kernel_copy_mb=-1)


@pytest.fixture(scope="module")
def prompt_ids(model_and_tokenizer):
    return [model_and_tokenizer[1].encode(p) for p in PROMPTS]


def assert_reference_tokens(core, prompt_ids, reference_model, label: str) -> None:
    """Every prompt x4, batched: a first step of > 128 rows, then decode steps of 6 rows;
    each greedy token is the reference's argmax given the tokens before it (teacher
    forcing), but for numerical ties."""
    prompt = [ids * 4 for ids in prompt_ids]
    assert sum(map(len, prompt)) > QuantLinear.GEMM_ROWS
    for i, ids in enumerate(prompt):
        core.add(str(i), ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                             ignore_eos=True))  # fmt: skip
    out = run_to_end(core)
    for i, ids in enumerate(prompt):
        gen = out[str(i)]
        assert len(gen) == NEW_TOKENS
        with torch.no_grad():
            logits = reference_model(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1]
        top2 = logits.topk(2, dim=-1).values
        for step, token in enumerate(gen):
            ref = int(logits[step].argmax())
            gap = float(top2[step, 0] - top2[step, 1])
            assert token == ref or gap < TIE, f"{label} prompt {i} step {step}: {token} vs {ref}"


@pytest.mark.parametrize("path", ["native", "sliced", "copy"])
def test_greedy_tokens_equal_the_reference_under_each_forced_path(
    path, model, make_core, prompt_ids, reference_model
):
    core = make_core(kernel_choice="native", enable_prefix_cache=False)
    force(model, path)
    assert_reference_tokens(core, prompt_ids, reference_model, path)


@pytest.fixture(scope="module")
def avx2_model():
    """The default model built while TANDEM_KERNELS=avx2 (kept set: the norms and attention
    follow it per call): every kernel of the module's steps runs the AVX2 build."""
    if not VARIANTS["avx2"][1] <= cpu_flags():
        pytest.skip("this CPU cannot run the avx2 build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_KERNELS", "avx2")
        torch.set_num_threads(1)
        assert library()[1] == "avx2"
        loaded, tokenizer = load_model("default", weights="native")
        yield LlamaModel(loaded), tokenizer


@pytest.mark.parametrize("path", ["native", "sliced", "copy"])
def test_on_the_avx2_build_greedy_tokens_equal_the_reference_under_each_forced_path(
    path, avx2_model, prompt_ids, reference_model
):
    from libs.common.engine.step_loop import EngineCore

    model, tokenizer = avx2_model
    config = EngineConfig(kv_cache_mb=64, kernel_choice="native", enable_prefix_cache=False)
    core = EngineCore(config, model, tokenizer)
    force(model, path)
    assert_reference_tokens(core, prompt_ids, reference_model, f"avx2 {path}")


@pytest.mark.parametrize("path", ["measured", "sliced", "copy"])
def test_a_chunked_prefill_equals_an_unchunked_one_under_the_chosen_kernels(
    path, model, make_core, prompt_ids
):
    """Chunks of 200 rows and one step of 600 run the same product path (class > 128): the
    same greedy tokens and prompt log-probabilities."""
    prompt = ([t for ids in prompt_ids for t in ids] * 40)[:600]
    results = []
    for budget in (2048, 200):
        core = make_core(max_num_batched_tokens=budget, max_num_seqs=8, kernel_copy_mb=0,
                         enable_prefix_cache=False)  # fmt: skip
        if path != "measured":
            force(model, path)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
        core.add("p", prompt, params)
        tokens, scores = [], []
        while core.has_work():
            for o in core.step():
                tokens += o.token_ids
                scores += [lp.logprob for lp in o.prompt_logprobs]
        results.append((tokens, torch.tensor(scores)))
    (tokens, scores), (chunked_tokens, chunked_scores) = results
    assert len(tokens) == 8 and tokens == chunked_tokens
    assert scores.shape == chunked_scores.shape and len(scores) >= len(prompt) - 1
    # Attention over cached pages and the prompt scoring's row counts (256 a product) still
    # differ between the two: the same values to summation order, not the same bits.
    gap = float((scores - chunked_scores).abs().max())
    assert gap < 1e-3, gap
