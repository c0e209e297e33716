"""A forged write into a decode worker's reserved pages, on real processes: the decode
worker finds it by the prefill worker's handoff MAC and fails that request without
decoding; another request on the same workers meanwhile is exact. A write outside the
reserved pages is refused by the transfer server (the handoff's capability).

The attacker is a bus client that sees the PrefillRequest (its region descriptor and
token) and writes over a reserved page until the region is refused (the handoff fenced).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from libs.common.bus.connection import Bus
from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.engine import Engine
from libs.common.messages.control import PrefillRequest
from libs.common.transfer import RegionDescriptor, TransferError
from libs.common.transfer.tcp.engine import TcpTransferEngine
from libs.common.worker.handoff.protocol import KvLayout
from scripts.cluster import LocalCluster
from scripts.nats_server import NatsServer
from tests.workers.conftest import WORKER_ARGS, _wait_workers, generate, prompt_ids

FORGED, NEIGHBOUR = prompt_ids(400, seed=71), prompt_ids(90, seed=72)
MAX_ATTACK_S, MAX_WRITES = 120.0, 200_000


@pytest.fixture(scope="module")
def secret_cluster(tmp_path_factory, worker_env):
    workdir = tmp_path_factory.mktemp("handoff-mac")
    secret = workdir / "kv.secret"
    secret.write_text(os.urandom(32).hex())
    server = NatsServer(workdir / "nats").start()
    cluster = LocalCluster(server.url, env=worker_env, capture=workdir / "logs")
    args = [*WORKER_ARGS, "--no-pool", "true", "--kv-secret-file", str(secret)]
    try:
        cluster.start_one("prefill", "--service-id", "pm", *args, label="pm")
        cluster.start_one("decode", "--service-id", "dm", *args, label="dm")
        asyncio.run(_wait_workers(server.url, {"pm", "dm"}))
        yield server.url
    finally:
        cluster.stop()
        server.stop()


async def _reference_and_layout() -> tuple[list[int], int, int]:
    """Greedy output of NEIGHBOUR here, and the model's layers and KV slice size."""
    engine = Engine(EngineConfig(kv_cache_mb=48, enable_prefix_cache=False))
    await engine.start()
    try:
        kv = engine.core.kv_cache
        out: list[int] = []
        async for o in engine.add_request(NEIGHBOUR, SamplingParams(max_tokens=12,
                                                                    temperature=0)):  # fmt: skip
            out += o.token_ids
        return out, kv.num_layers, kv.slice_nbytes
    finally:
        await engine.stop()


class Attacker:
    """Overwrites layer 0's K of the first page reserved for request `target` (garbage,
    64 bytes) again and again until the decode worker's handoff region refuses it."""

    def __init__(self, bus: Bus, target: str, num_layers: int, slice_nbytes: int):
        self.bus, self.target = bus, target
        self.num_layers, self.slice_nbytes = num_layers, slice_nbytes
        self.landed = 0
        self.outside_refused = False  # a write to a page not reserved for the request
        self.refused = asyncio.Event()
        self.seen: asyncio.Queue[PrefillRequest] = asyncio.Queue()

    async def on_prefill(self, msg) -> None:
        req = PrefillRequest.decode(msg.data)
        if req.request_id == self.target:
            self.seen.put_nowait(req)

    async def run(self) -> None:
        req = await self.seen.get()
        remote = RegionDescriptor.from_dict(req.kv_region)
        layout = KvLayout(self.num_layers, req.kv_num_pages, self.slice_nbytes)
        offset = layout.offset(0, 0, req.page_indices[0])
        async with TcpTransferEngine(host="127.0.0.1", port=0, batch_timeout_s=10.0) as engine:
            src = engine.register(bytearray(b"\x7f" * 64))
            other = next(p for p in range(req.kv_num_pages) if p not in req.page_indices)
            try:
                await engine.write(src, remote, [(0, layout.offset(0, 0, other), 64)])
            except TransferError as e:
                self.outside_refused = "outside the granted ranges" in str(e)
            deadline = time.monotonic() + MAX_ATTACK_S
            for _ in range(MAX_WRITES):
                if time.monotonic() > deadline:
                    return
                try:
                    await engine.write(src, remote, [(0, offset, 64)])
                except TransferError:
                    self.refused.set()  # the handoff is over: its region is gone
                    return
                self.landed += 1


async def test_a_forged_page_write_fails_its_request_and_no_other(secret_cluster):
    expected, num_layers, slice_nbytes = await _reference_and_layout()
    bus = Bus(secret_cluster, "test-attacker", 5, 30)
    await bus.connect()
    try:
        attacker = Attacker(bus, "forged-1", num_layers, slice_nbytes)
        await bus.subscribe("tandem.prefill.pm.prefill", attacker.on_prefill)
        attack = asyncio.ensure_future(attacker.run())
        forged, neighbour = await asyncio.gather(
            generate(bus, "forged-1", FORGED, decode="dm", prefill="pm", max_tokens=12),
            generate(bus, "neighbour-1", NEIGHBOUR, decode="dm", prefill="pm", max_tokens=12),
        )
        await asyncio.wait_for(attack, 30)
    finally:
        await bus.close()
    assert attacker.outside_refused  # the handoff's capability: the reserved pages only
    assert attacker.landed > 0 and attacker.refused.is_set()
    assert forged.finish_reason == "error" and "failed verification" in (forged.error or "")
    assert len(forged.token_ids) <= 1 and forged.workers == ["dm", "pm"]  # token 0 only
    assert neighbour.error is None and neighbour.token_ids == expected
