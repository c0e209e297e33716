"""SSE framing and the merging of several choices' streams."""

import asyncio

import pytest

from services.router.streaming import DONE, merge, parse_sse, sse


def test_sse_event_is_one_data_line_even_with_newlines_in_text():
    raw = sse({"text": "a\nb\r\n\n"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n") == 2
    assert parse_sse(raw + DONE) == [{"text": "a\nb\r\n\n"}, "[DONE]"]


def test_done_terminates_the_stream_as_openai_does():
    assert DONE == b"data: [DONE]\n\n"


async def _gen(items, delay=0.0, fail=None, closed=None):
    try:
        for item in items:
            await asyncio.sleep(delay)
            yield item
        if fail:
            raise fail
    finally:
        if closed is not None:
            closed.append(items[0])


async def test_merge_yields_every_item_of_every_source():
    out = [x async for x in merge([_gen([1, 2, 3], 0.001), _gen([10, 20], 0.002)])]
    assert sorted(out) == [1, 2, 3, 10, 20]


async def test_merge_raises_the_first_error_and_closes_every_source():
    closed = []
    sources = [_gen([1], fail=ValueError("boom"), closed=closed),
               _gen(list(range(100, 200)), 0.01, closed=closed)]  # fmt: skip
    with pytest.raises(ValueError, match="boom"):
        async for _ in merge(sources):
            pass
    assert sorted(closed) == [1, 100]


async def test_leaving_merge_early_closes_the_sources():
    closed = []
    merged = merge([_gen(list(range(10)), 0.001, closed=closed),
                    _gen(list(range(50, 60)), 0.001, closed=closed)])  # fmt: skip
    async for _ in merged:
        break
    await merged.aclose()
    assert sorted(closed) == [0, 50]
