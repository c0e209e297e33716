"""The asyncio Engine: streams, abort, prefill-only + KV export/import, KV events."""

from __future__ import annotations

import contextlib

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.sequence import pages_for

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompt(tokenizer) -> list[int]:
    return tokenizer.encode("The history of the printing press begins in " * 3)


async def _collect(stream):
    return [out async for out in stream]


async def test_stream_yields_deltas_until_finished(make_engine, tokenizer):
    engine = await make_engine()
    outs = await _collect(engine.add_request(_prompt(tokenizer), GREEDY))
    assert sum(len(o.token_ids) for o in outs) == 10
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    text = "".join(o.text for o in outs)
    assert text == tokenizer.decode([t for o in outs for t in o.token_ids])


async def test_abort_ends_the_stream_and_frees_pages(make_engine, tokenizer):
    engine = await make_engine(enable_prefix_cache=False)
    free = engine.core.scheduler.num_free_pages
    stream = engine.add_request(_prompt(tokenizer), SamplingParams(max_tokens=500), request_id="a")
    first = await anext(stream)
    assert not first.finished
    await engine.abort("a")
    rest = await _collect(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert engine.core.scheduler.num_free_pages == free


async def test_leaving_a_stream_early_aborts_the_request(make_engine, tokenizer):
    engine = await make_engine(enable_prefix_cache=False)
    free = engine.core.scheduler.num_free_pages
    stream = engine.add_request(_prompt(tokenizer), SamplingParams(max_tokens=500), request_id="b")
    async with contextlib.aclosing(stream):
        async for _ in stream:
            break
    assert engine.core.scheduler.get("b") is None
    assert engine.core.scheduler.num_free_pages == free


async def test_prefill_only_then_import_decodes_like_one_engine(make_engine, tokenizer):
    prompt = _prompt(tokenizer)
    events = []
    prefill = await make_engine()
    prefill.on_kv_event = events.append
    decode = await make_engine()
    whole = [t for o in await _collect(decode.add_request(prompt, GREEDY)) for t in o.token_ids]

    outs = await _collect(prefill.add_request(prompt, GREEDY, request_id="r", prefill_only=True))
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason is None
    first = outs[0].token_ids[0]
    src_pages = outs[0].page_table[: pages_for(len(prompt), 16)]
    data = await prefill.export_pages(src_pages)
    await prefill.release("r")
    assert any(e.kind == "stored" for e in events), "prefill should report stored pages"

    dst_pages = await decode.reserve("r", prompt, GREEDY)
    assert len(dst_pages) == len(src_pages)
    await decode.import_pages(dst_pages, data)
    rest = await _collect(decode.decode_imported("r", first))
    assert [t for o in rest for t in o.token_ids] == whole
