"""The start/stop pair and the state machine every transport inherits."""

from __future__ import annotations

import socket

import pytest
import structlog

from libs.common.transfer import EngineState, create_engine
from libs.common.transfer.shm.engine import ShmTransferEngine
from libs.common.transfer.tcp.engine import TcpTransferEngine


async def test_stop_is_idempotent_and_safe_before_start() -> None:
    engine = TcpTransferEngine()
    await engine.stop()
    await engine.stop()
    assert engine.state is EngineState.STOPPED
    with pytest.raises(RuntimeError, match="not new"):
        await engine.start()


async def test_methods_need_a_running_engine() -> None:
    engine = TcpTransferEngine()
    with pytest.raises(RuntimeError, match="not running"):
        engine.register(bytearray(8))
    async with engine:
        desc = engine.register(bytearray(8))
        assert engine.info()["regions"] == 1
        with pytest.raises(RuntimeError, match="not new"):
            await engine.start()
    with pytest.raises(RuntimeError, match="not running"):
        await engine.write(desc, desc, [(0, 0, 1)])
    assert engine.info() == {"transport": "tcp", "endpoint": None, "state": "stopped",
                             "regions": 0, "connections_per_peer": 3,
                             "slice_bytes": 1 << 20, "stall_timeout_s": 10.0, "busy_poll_us": 50.0,
                             "thread_send_bytes": 1 << 20, "first_frame_timeout_s": 10.0,
                             "frame_timeout_s": 10.0, "max_server_connections": 256,
                             "max_connections_per_ip": 64,
                             "peer_connections": 0, "server_connections": 0}  # fmt: skip


async def test_failed_start_leaves_a_stopped_engine() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        engine = TcpTransferEngine(port=busy.getsockname()[1])
        with pytest.raises(OSError):
            await engine.start()
    assert engine.state is EngineState.STOPPED
    await engine.stop()


async def test_info_shows_transport_and_endpoint() -> None:
    async with TcpTransferEngine() as engine:
        info = engine.info()
        assert info["transport"] == "tcp" and info["state"] == "running"
        assert info["endpoint"].startswith("127.0.0.1:")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_start_logs_the_transport_in_use_and_its_endpoint(transport: str) -> None:
    with structlog.testing.capture_logs() as logs:
        async with create_engine(transport) as engine:
            endpoint = engine.endpoint
    started = [e for e in logs if e["event"] == "transfer engine started"]
    assert len(started) == 1
    assert started[0]["transport"] == transport and started[0]["endpoint"] == endpoint


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"port": 70000}, "port"),
        ({"connections_per_peer": 0}, "connections_per_peer"),
        ({"slice_bytes": 0}, "slice_bytes"),
        ({"busy_poll_us": -1}, "busy_poll_us"),
        ({"busy_poll_bytes": -1}, "busy_poll_bytes"),
        ({"thread_send_bytes": -1}, "thread_send_bytes"),
    ],
)
def test_bad_tcp_config_names_the_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TcpTransferEngine(**kwargs)


def test_bad_shm_config_names_the_parameter(tmp_path) -> None:
    with pytest.raises(ValueError, match="shm_dir"):
        ShmTransferEngine(shm_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="copy_threads"):
        ShmTransferEngine(copy_threads=0)


def test_registry_picks_tcp_without_a_device_and_imports_lazily() -> None:
    import sys

    engine = create_engine(None)
    assert engine.transport == "tcp"
    assert "pyverbs" not in sys.modules
    assert create_engine("shm").transport == "shm"
    with pytest.raises(ValueError, match="transport"):
        create_engine("carrier-pigeon")


def test_registry_defaults_to_rdma_where_a_device_and_pyverbs_exist(monkeypatch) -> None:
    from libs.common.transfer import registry

    monkeypatch.setattr(registry, "rdma_devices", lambda: ["mlx5_0"])
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    assert registry.default_transport() == "tcp"  # a device without pyverbs
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    assert registry.default_transport() == "rdma"
    monkeypatch.setattr(registry, "rdma_devices", lambda: [])
    assert registry.default_transport() == "tcp"  # pyverbs without a device


async def test_cuda_or_other_device_tensors_are_refused_by_name() -> None:
    import torch

    async with TcpTransferEngine() as engine:
        with pytest.raises(ValueError, match="buffer: meta memory is not reachable"):
            engine.register(torch.empty(16, device="meta"))
