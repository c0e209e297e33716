"""What the fault tests send, and the greedy reference output of each prompt.

All prompts are in one place so that one engine computes every reference at once, while
the cluster starts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.engine import Engine


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of n ordinary token ids; distinct seeds share no first page."""
    base = [504, 3458, 282, 4649, 314, 253, 1219, 28, 1953, 260, 1345, 2107, 30, 378, 3117]
    return [1] + [base[(i * 7 + seed) % len(base)] + 3 * seed for i in range(n - 1)]


@dataclass(frozen=True)
class Case:
    """Prompts a test sends, with its sampling (greedy)."""

    prompts: list[list[int]]
    max_tokens: int
    ignore_eos: bool = False


# What the tests send, in one place, so that one engine computes every reference at once.
CASES = {
    "decode_kill": Case([prompt_ids(40 + 8 * i, seed=10 + i) for i in range(4)], 48, True),
    "after_decode_kill": Case([prompt_ids(48, seed=20 + i) for i in range(2)], 12),
    "prefill_kill": Case([prompt_ids(150 + 4 * i, seed=30 + i) for i in range(6)], 8),
    "store_kill": Case([prompt_ids(100, seed=40), prompt_ids(120, seed=41)], 8),
    "master_kill": Case([prompt_ids(70 + 10 * i, seed=50 + i) for i in range(6)], 6),
    "nats_restart": Case([prompt_ids(60 + 10 * i, seed=60 + i) for i in range(6)], 6),
    "nats_blip": Case([prompt_ids(50 + 10 * i, seed=80 + i) for i in range(4)], 64, True),
}


async def references(cases: dict[str, Case]) -> dict[str, list[str]]:
    """Greedy texts of the engine in this process, no prefix cache, one torch thread (as
    the workers). All batched: the engine's tests prove batched equals alone."""
    engine = Engine(EngineConfig(kv_cache_mb=96, enable_prefix_cache=False, num_threads=1))
    await engine.start()

    async def one(ids: list[int], params: SamplingParams) -> str:
        return "".join([o.text async for o in engine.add_request(ids, params)])

    async def case(c: Case) -> list[str]:
        params = SamplingParams(max_tokens=c.max_tokens, temperature=0, ignore_eos=c.ignore_eos)
        return list(await asyncio.gather(*(one(ids, params) for ids in c.prompts)))

    try:
        texts = await asyncio.gather(*(case(c) for c in cases.values()))
    finally:
        await engine.stop()
    return dict(zip(cases, texts, strict=True))
