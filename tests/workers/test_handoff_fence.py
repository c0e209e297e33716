"""A KV handoff the transfer engine cannot fence (the prefill worker froze mid-copy):
the decode worker fails the request and retires its pages instead of freeing them."""

from __future__ import annotations

import pytest

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.engine import Engine
from libs.common.transfer.shm import segment as shm_segment
from libs.common.transfer.shm.engine import ShmTransferEngine
from libs.common.worker.service import WorkerService
from services.decode.config import DecodeConfig
from tests.workers.conftest import prompt_ids


async def test_an_unfenced_handoff_fails_and_its_pages_are_never_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_segment, "FENCE_TIMEOUT_S", 0.05)
    engine = Engine(EngineConfig(kv_cache_mb=8, enable_prefix_cache=False))
    decode_side = ShmTransferEngine(shm_dir=str(tmp_path))
    prefill_side = ShmTransferEngine(shm_dir=str(tmp_path))
    await engine.start()
    try:
        async with decode_side, prefill_side:
            svc = WorkerService(DecodeConfig(service_id="d-fence"), "decode")
            core = svc.core
            core.engine, core.transfer = engine, decode_side
            core.kv_region = decode_side.register(decode_side.allocate(4096))
            handoff = decode_side.register(decode_side.allocate(4096))
            pages = await engine.reserve("r1", prompt_ids(40), SamplingParams(max_tokens=4))
            src = prefill_side.register(prefill_side.allocate(4096))
            await prefill_side.write(src, handoff, [(0, 0, 16)])
            prefill_side._segment(handoff).pin(handoff.region_id)  # frozen mid-copy
            with pytest.raises(RuntimeError, match="could not be fenced"):
                await svc.decode.receiver.revoke(handoff, "r1")
            scheduler = engine.core.scheduler
            assert scheduler.get("r1") is None and scheduler.retired_pages == len(pages)
            assert svc.details()["retired_kv_pages"] == len(pages)  # operators see it
            again = await engine.reserve("r2", prompt_ids(40, seed=3), SamplingParams())
            assert again is not None and not set(again) & set(pages)
    finally:
        await engine.stop()
