"""Tokenizer from GGUF metadata, chat template, incremental detokenization."""

from __future__ import annotations

import pytest

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.stop import StopChecker
from libs.common.engine.load.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! 12345 apples cost $6.78.",
    "  leading spaces and\ttabs\nnew lines",
    "Über café naïve — 東京 タワー 🚀🎉 👩‍💻",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_markers_encode_to_single_special_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"


def test_digits_are_split_one_per_token_like_smollm2(tokenizer):
    ids = tokenizer.encode("2024")
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template_renders_system_default_and_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_never_emits_broken_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_string_truncates_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode("one two three four five")
    checker = StopChecker(SamplingParams(stop=("three",)), tokenizer)
    streamed, hit = "", False
    for i in ids:
        delta, hit = checker.step(i, None)
        streamed += delta
        if hit:
            break
    assert hit and streamed == "one two "
