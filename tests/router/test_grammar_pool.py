"""The grammar pool (libs/common/grammar/pool.py) with real worker processes and the default
model's tokenizer: a grammar past the deadline is refused and its worker replaced, the
pool serves the next one, and answers are cached by content."""

from __future__ import annotations

import asyncio
import os
import resource
import time

import pytest

from libs.common.engine.load.source import default_model_path, load_tokenizer
from libs.common.grammar import build
from libs.common.grammar.build import GrammarError
from libs.common.grammar.pool import GrammarPool, GrammarPoolBusy

DEADLINE = 0.5


def chain(rules: int) -> str:
    """A GBNF grammar whose rules each need the next: llguidance's converter finds one
    terminal rule per pass over all of them (quadratic; 2,000 rules: seconds)."""
    lines = ["root ::= r0"]
    lines += [f'r{i} ::= "a" r{i + 1}' for i in range(rules - 1)]
    lines.append(f'r{rules - 1} ::= "a"')
    return "\n".join(lines) + "\n"


async def _run(pool: GrammarPool, kind: str, source: str) -> str:
    items = [(kind, source)]
    (text,) = await pool.run(GrammarPool.key(items), kind, items)
    return text


def test_a_grammar_past_the_deadline_is_refused_and_the_pool_serves_the_next_one():
    tok, _, _ = load_tokenizer(default_model_path())
    pool = GrammarPool(tok.tokenizer.to_str(), tok.vocab_size, tok.eos_token_ids, workers=1,
                       deadline=DEADLINE, max_queued=1)  # fmt: skip
    pool.start()

    async def scenario() -> None:
        slow = chain(3000)
        started = time.monotonic()
        first = asyncio.ensure_future(_run(pool, "ebnf", slow))
        await asyncio.sleep(0)  # one turn of the loop: `first` holds the only place
        with pytest.raises(GrammarPoolBusy):  # past max_queued: refused at once
            await _run(pool, "regex", "[a-z]")
        with pytest.raises(GrammarError) as e:
            await first
        assert time.monotonic() - started < DEADLINE + 5  # the deadline, and the kill
        assert e.value.param == "ebnf" and "too complex" in str(e.value)
        assert f"{DEADLINE:g} s" in str(e.value) and pool.timeouts == 1
        # The only worker was killed: the next grammar waits for its replacement.
        assert await _run(pool, "regex", "[0-9]{3}") == build.regex("[0-9]{3}")
        jobs = pool.jobs
        with pytest.raises(GrammarError):  # the same grammar again: refused from the cache
            await _run(pool, "ebnf", slow)
        assert pool.jobs == jobs and pool.timeouts == 1

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        pool.close()
        pool.close()  # safe twice


def test_the_same_grammar_asked_at_once_and_again_costs_one_job(grammar_pool):
    schema = '{"type": "object", "properties": {"pool": {"type": "integer"}}}'

    async def scenario() -> list[str]:
        return list(await asyncio.gather(*(_run(grammar_pool, "json", schema) for _ in range(4))))

    jobs = grammar_pool.jobs
    texts = asyncio.run(scenario()) + asyncio.run(scenario())
    assert grammar_pool.jobs == jobs + 1
    assert set(texts) == {build.from_source("json", schema, "x")}


def test_a_refused_grammar_names_its_param_and_the_worker_keeps_serving(grammar_pool):
    with pytest.raises(GrammarError) as e:
        asyncio.run(_run(grammar_pool, "ebnf", "root ::= missing_rule"))
    assert e.value.param == "ebnf" and "missing_rule" in str(e.value)
    assert asyncio.run(_run(grammar_pool, "regex", "ok|no")) == build.regex("ok|no")


def test_a_worker_whose_pipes_are_past_fd_1024_still_answers():
    """A busy router holds thousands of sockets: a worker restarted then gets pipes past
    select()'s FD_SETSIZE (1024); its replies must still be read."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 and hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 2048: cannot open 1,100 files")
    if soft != resource.RLIM_INFINITY and soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    tok, _, _ = load_tokenizer(default_model_path())
    pool = GrammarPool(tok.tokenizer.to_str(), tok.vocab_size, tok.eos_token_ids, workers=1)
    try:
        pool.start()
        assert asyncio.run(_run(pool, "regex", "high|fd")) == build.regex("high|fd")
    finally:
        pool.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_cached_refusal_names_the_field_of_the_request_that_asks(grammar_pool):
    for param in ("regex", "guided_regex", "regex"):
        items = [("regex", "(unclosed")]
        with pytest.raises(GrammarError) as e:
            asyncio.run(grammar_pool.run(GrammarPool.key(items), param, items))
        assert e.value.param == param
