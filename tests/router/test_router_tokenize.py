"""Prompt tokenization off the event loop (services/router/requests/prompts.py `encode`): the
same ids as the engine's tokenizer, and the GIL free while the tokenizer works."""

import itertools
import threading
import time

import pytest

from libs.common.engine.load.source import load_tokenizer
from services.router.config import RouterConfig
from services.router.requests.prompts import PromptTooLong, encode


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")[0]


TEXTS = [
    "", "hi", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "ünïcödé 日本語 🦊🦊",
    "x" * 5000, "1234567890" * 50, "def f(x):\n    return x ** 2  # code\n",
]  # fmt: skip


def test_encode_gives_the_engine_tokenizers_ids(tokenizer):
    for text in TEXTS:
        assert encode(tokenizer, text) == tokenizer.encode(text), text


def test_encode_lets_other_threads_run_while_it_tokenizes(tokenizer):
    words = "the quick brown fox jumps over a lazy dog".split()
    text = " ".join(itertools.islice(itertools.cycle(words), 600_000))  # ~2.6 MiB
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:  # what the event loop would be doing meanwhile
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    try:
        ids = encode(tokenizer, text)
    finally:
        took = time.perf_counter() - started
        done.set()
        ticker.join()
    assert len(ids) > 500_000
    # tokenizer.encode holds the GIL throughout: the ticker's gap would be `took`.
    assert took > 0.3, f"too fast to tell ({took:.2f}s)"
    assert max(gaps) < took / 2, (max(gaps), took)


def test_heartbeat_timeout_must_cover_two_intervals():
    with pytest.raises(ValueError, match="--heartbeat-timeout"):
        RouterConfig(heartbeat_interval=1.0, heartbeat_timeout=1.5)
    assert RouterConfig(heartbeat_interval=0.5, heartbeat_timeout=1.0).heartbeat_timeout == 1.0


def test_a_prompt_past_the_limit_is_counted_not_listed(tokenizer):
    text = "the quick brown fox " * 100
    n = len(tokenizer.encode(text))
    assert encode(tokenizer, text, limit=n) == tokenizer.encode(text)
    with pytest.raises(PromptTooLong) as e:
        encode(tokenizer, text, limit=n - 1)
    assert e.value.num_tokens == n
