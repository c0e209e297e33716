"""Traced requests for the cross-process trace tests: a prompt no cache holds, a streamed
chat request through a router, and the root span the router exported for it."""

from __future__ import annotations

import time
import uuid

import aiohttp

from tests.router.otlp_receiver import OtlpReceiver, ReceivedSpan


def fresh_prompt() -> str:
    words = uuid.uuid4().hex  # a prompt no cache holds: the prefill worker computes it
    return " ".join(f"{words[i % 32]}{i}" for i in range(120))


async def chat_stream(url: str, label: str, prompt: str = "") -> tuple[int, int, bytes]:
    """A streamed chat request (16 tokens out): (send ns, last byte ns, body)."""
    body = {"model": "default", "stream": True, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": prompt or fresh_prompt()}]}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        sent = time.time_ns()
        async with http.post(f"{url}/v1/chat/completions", json=body,
                             headers={"x-request-id": label}) as r:  # fmt: skip
            assert r.status == 200, await r.text()
            data = await r.read()
        return sent, time.time_ns(), data


def root_span(receiver: OtlpReceiver, label: str) -> ReceivedSpan | None:
    """The trace's root for the request the client labelled `label` (x-request-id)."""
    roots = [s for s in list(receiver.spans)
             if s.name == "POST /v1/chat/completions"
             and s.attributes.get("tandem.request_id") == label]  # fmt: skip
    return roots[0] if roots else None
