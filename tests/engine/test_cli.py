"""The stable CLI: `python -m libs.common.engine generate ... --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_generate_json_prints_generated_ids_and_text(tokenizer):
    cmd = [sys.executable, "-m", "libs.common.engine", "generate", "--prompt",
           "What is the capital of France?", "--chat", "--max-tokens", "8", "--threads", "1",
           "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=240)
    result = json.loads(out.stdout)
    assert 1 <= len(result["token_ids"]) <= 8
    assert result["text"] == tokenizer.decode(result["token_ids"])
    assert "Paris" in result["text"]


@pytest.mark.slow
def test_ignore_eos_generates_exactly_max_tokens_and_reports_tokens_per_s():
    cmd = [sys.executable, "-m", "libs.common.engine", "generate", "--prompt",
           "What is the capital of France?", "--chat", "--max-tokens", "40", "--threads", "1",
           "--ignore-eos", "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=240)
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == result["completion_tokens"] == 40
    assert result["finish_reason"] == "length" and result["tokens_per_s"] > 0


def test_bad_model_exits_with_an_error_naming_the_flag():
    cmd = [sys.executable, "-m", "libs.common.engine", "generate", "--prompt", "x", "--model",
           "/nonexistent.gguf", "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "model" in out.stderr
