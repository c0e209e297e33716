"""Each limit of a request's budget (services/router/admission/budget.py), alone: refused
just past it with a 400 naming the parameter, the limit and its flag, accepted at it; and
the checks cost microseconds whatever the body holds."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from services.router.admission import budget
from services.router.config import RouterConfig
from services.router.errors import ApiError
from services.router.formats.bodies import INLINE_BYTES, decode, off_loop
from services.router.formats.openai.validation import parse_request

CONFIG = RouterConfig(
    max_prompt_chars=100,
    max_prompt_ids=50,
    max_messages=4,
    max_generated_tokens=1000,
    max_logprob_values=2100,
)
CONTEXT = 8192
USER = {"role": "user", "content": "hi"}


def refused(call, param: str, flag: str) -> ApiError:
    with pytest.raises(ApiError) as e:
        call()
    assert e.value.status == 400 and e.value.param == param, e.value.body()
    assert flag in e.value.message, e.value.message
    return e.value


def checked(endpoint: str, body: dict) -> None:
    api = parse_request(endpoint, budget.raw({"model": "m", **body}, CONFIG), max_n=16)
    budget.check(api, CONFIG, CONTEXT)


def test_a_prompt_of_ids_past_the_limit_is_refused_before_it_is_validated():
    huge = [0] * 8_000_000
    start = time.perf_counter()
    e = refused(lambda: budget.raw({"prompt": huge}, CONFIG), "prompt", "--max-prompt-ids")
    assert time.perf_counter() - start < 0.01  # O(1): the list is not walked
    assert "8000000" in e.message and "50" in e.message
    checked("completions", {"prompt": list(range(1, 51))})  # at the limit


def test_decode_leaves_the_garbage_collector_as_it_found_it():
    # (--max-body-items is read as the body arrives: tests/router/test_frontdoor_budget.py)
    assert gc.isenabled()
    assert decode(b"[" + b"[]," * 1000 + b"[]]") == [[]] * 1001
    assert gc.isenabled()
    with pytest.raises(ApiError) as e:
        decode(b"[[],")
    assert e.value.status == 400 and gc.isenabled()


def test_a_list_of_prompts_past_max_n_is_refused_before_it_is_walked():
    e = refused(lambda: budget.raw({"prompt": ["a"] * 17}, CONFIG), "prompt", "--max-n")
    assert "17 prompts" in e.message
    refused(lambda: budget.raw({"prompt": [[1]] * 17}, CONFIG), "prompt", "--max-n")
    budget.raw({"prompt": ["a"] * 16}, CONFIG)


def test_prompts_of_ids_count_together():
    refused(lambda: checked("completions", {"prompt": [[1] * 30, [2] * 21]}), "prompt",
            "--max-prompt-ids")  # fmt: skip
    checked("completions", {"prompt": [[1] * 30, [2] * 20]})


def test_prompt_text_past_the_character_limit_is_refused():
    refused(lambda: checked("completions", {"prompt": "x" * 101}), "prompt", "--max-prompt-chars")
    refused(lambda: checked("completions", {"prompt": ["x" * 60, "y" * 41]}), "prompt",
            "--max-prompt-chars")  # fmt: skip
    checked("completions", {"prompt": "x" * 100})


def test_messages_past_their_count_or_characters_are_refused():
    refused(lambda: checked("chat", {"messages": [USER] * 5}), "messages", "--max-messages")
    long = [{"role": "system", "content": "s" * 60}, {"role": "user", "content": "u" * 41}]
    refused(lambda: checked("chat", {"messages": long}), "messages", "--max-prompt-chars")
    checked("chat", {"messages": [USER] * 4, "max_tokens": 10})


def test_responses_input_and_detokenize_tokens_are_bounded_raw():
    refused(lambda: budget.raw({"input": [USER] * 5}, CONFIG), "input", "--max-messages")
    refused(lambda: budget.raw({"input": "x" * 101}, CONFIG), "input", "--max-prompt-chars")
    refused(lambda: budget.raw({"tokens": [1] * 51}, CONFIG), "tokens", "--max-prompt-ids")


def test_prompts_x_n_x_max_tokens_past_the_limit_is_refused():
    body = {"prompt": ["a", "b"], "n": 5, "max_tokens": 101}  # 2 x 5 x 101 = 1010
    e = refused(lambda: checked("completions", body), "max_tokens", "--max-generated-tokens")
    assert "1010" in e.message and "1000" in e.message
    checked("completions", {**body, "max_tokens": 100})


def test_an_unset_max_tokens_counts_as_the_whole_context():
    chat = {"messages": [USER]}
    refused(lambda: checked("chat", chat), "max_tokens", "--max-generated-tokens")
    checked("chat", {**chat, "max_tokens": 1000})


def test_n_x_max_tokens_x_top_logprobs_past_the_limit_is_refused():
    chat = {"messages": [USER], "logprobs": True, "top_logprobs": 20, "n": 4, "max_tokens": 25}
    checked("chat", chat)  # 4 x 25 x 21 = 2100: at the limit
    e = refused(lambda: checked("chat", {**chat, "max_tokens": 26}), "top_logprobs",
                "--max-logprob-values")  # fmt: skip
    assert "2184" in e.message
    completion = {"prompt": "x", "logprobs": 20, "n": 4, "max_tokens": 26}
    refused(lambda: checked("completions", completion), "logprobs", "--max-logprob-values")


def test_logprobs_without_alternatives_still_count_one_value_a_token():
    # 1000 tokens x (1 + 0) fits 2100; the generated-tokens limit is the one met first.
    checked("chat", {"messages": [USER], "logprobs": True, "max_tokens": 1000})


@pytest.mark.parametrize(
    "flag",
    ["max_body_bytes", "max_prompt_chars", "max_prompt_ids", "max_messages",
     "max_generated_tokens", "max_logprob_values"],
)  # fmt: skip
def test_every_budget_flag_must_be_positive(flag):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')}"):
        RouterConfig(**{flag: 0})


async def test_a_large_body_is_parsed_in_a_thread_and_a_small_one_inline():
    loop_thread = threading.get_ident()
    assert await off_loop(INLINE_BYTES, threading.get_ident) == loop_thread
    assert await off_loop(INLINE_BYTES + 1, threading.get_ident) != loop_thread


async def test_the_event_loop_runs_while_a_large_body_is_checked():
    """Validation of 1M ids (pure Python, ~0.1-0.5 s) in the thread: a 5 ms ticker on the
    loop keeps ticking."""
    big = {"model": "m", "prompt": list(range(1, 1_000_001))}
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    api = await off_loop(INLINE_BYTES + 1, lambda: parse_request("completions", big, 1))
    done.set()
    await ticker
    assert len(api.prompts[0]) == 1_000_000
    assert len(gaps) > 3 and max(gaps) < 0.1, max(gaps)
