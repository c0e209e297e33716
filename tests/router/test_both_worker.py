"""One `--role both` worker and a router are a whole serving cluster (real processes)."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from bench.deployments import Deployment, Topology
from libs.common.engine.load.source import load_tokenizer
from tests.workers.conftest import reference

pytestmark = pytest.mark.slow


async def test_a_single_both_worker_serves_through_the_router(tmp_path):
    topo = Topology("both", 0, 0, ["--num-threads", "1", "--kv-cache-mb", "32",
                                   "--transport", "tcp", "--no-pool", "true"], both=1)  # fmt: skip
    deployment = Deployment(topo, tmp_path)
    try:
        await deployment.start(timeout=240)
        async with aiohttp.ClientSession() as http:
            async with http.get(deployment.url.removesuffix("/v1") + "/health") as r:
                body = await r.json()
        assert r.status == 200 and body["workers"]["both"] == 1
        assert body["workers"].get("prefill", 0) == body["workers"].get("decode", 0) == 0
        prompt = [1, 504, 3458, 282, 4649, 314, 253, 1219, 28, 1953, 260, 1345]
        async with openai.AsyncOpenAI(base_url=deployment.url, api_key="x", max_retries=0,
                                      timeout=120) as c:  # fmt: skip
            r = await c.completions.create(
                model="default", prompt=prompt, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 6
        expected = (await reference([prompt], max_tokens=6))[0]
        assert r.choices[0].text == load_tokenizer("default")[0].decode(expected)
    finally:
        deployment.stop()
