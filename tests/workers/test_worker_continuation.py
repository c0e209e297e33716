"""A migrated request on real workers (`GenerateRequest.generated`): the decode worker
prefills prompt + generated itself and streams exactly the rest of the greedy completion,
numbered after the tokens the client has, with usage over the whole response."""

from tests.workers.conftest import generate, prompt_ids, reference

PROMPT = prompt_ids(70, seed=7)


async def test_a_continuation_streams_the_rest_of_the_greedy_completion(bus):
    (want,) = await reference([PROMPT], max_tokens=12)
    for decode in ("d1", "d2"):  # a decode worker, and a `both` worker
        got = await generate(bus, f"cont-{decode}", PROMPT, decode=decode, prefill="p1",
                             max_tokens=12, generated=want[:5])  # fmt: skip
        assert got.error is None, got.error
        assert got.token_ids == want[5:]
        assert got.workers == [decode]  # prefilled there, whatever prefill_worker said
        assert got.usage.prompt_tokens == len(PROMPT) and got.usage.completion_tokens == 12
        assert got.accepted.num_reserved_pages == 0


async def test_a_continuation_its_tokens_already_end_is_one_final_chunk(bus):
    (want,) = await reference([PROMPT], max_tokens=12)
    got = await generate(bus, "cont-done", PROMPT, decode="d1", max_tokens=12, generated=want)
    assert got.token_ids == [] and got.text == "" and got.finish_reason == "length"
    assert got.usage.completion_tokens == 12
