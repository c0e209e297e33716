"""bench.bus_watch: the bench knows requests by their X-Request-Id, which the bus carries
as the GenerateRequest's label (the router's own request ids are keys on the bus)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.bus_watch import Seen
from libs.common.messages.control import (
    GenerateRequest,
    SamplingSpec,
    TokenChunk,
    encode_chunk_batch,
)


def _generate(rid: str, label: str) -> SimpleNamespace:
    subject = f"tandem.stream.r.{rid}"
    request = GenerateRequest(request_id=rid, token_ids=[1, 2], sampling=SamplingSpec(),
                              stream_subject=subject, router="r", label=label)  # fmt: skip
    return SimpleNamespace(data=request.encode())


def _chunk(rid: str, index: int) -> TokenChunk:
    return TokenChunk(request_id=rid, index=index, token_ids=[7], worker="w", text="x")


async def test_chunks_are_filed_under_the_client_request_id():
    seen = Seen()
    await seen.on_generate(_generate("17", "bench-a"))
    await seen.on_generate(_generate("18", ""))  # no X-Request-Id: the bus id stands
    await seen.on_chunk(SimpleNamespace(data=_chunk("17", 0).encode()))
    batch = encode_chunk_batch("w", [_chunk("17", 1).encode(), _chunk("18", 0).encode()])
    await seen.on_batch(SimpleNamespace(data=batch))
    assert set(seen.generate) == {"bench-a", "18"}
    assert len(seen.chunks["bench-a"]) == 2 and len(seen.chunks["18"]) == 1
    assert "17" not in seen.chunks
