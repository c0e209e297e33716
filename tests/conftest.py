"""Shared fixtures: a real nats-server per test, visible skips for GPU/RDMA tests, this
process's spans (tracing on, exported in memory) and an OTLP receiver for services' spans."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libs.common import tracing
from scripts.nats_server import NatsServer


def _has_gpu() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU on this machine"
    return True, ""


def _has_rdma() -> tuple[bool, str]:
    devices = Path("/sys/class/infiniband")
    if devices.is_dir() and any(devices.iterdir()):
        return True, ""
    return False, "no RDMA device (/sys/class/infiniband is empty)"


def pytest_collection_modifyitems(config, items):
    checks = {"gpu": _has_gpu, "rdma": _has_rdma}
    results: dict[str, tuple[bool, str]] = {}
    for item in items:
        for marker, check in checks.items():
            if marker in item.keywords:
                if marker not in results:
                    results[marker] = check()
                ok, why = results[marker]
                if not ok:
                    item.add_marker(pytest.mark.skip(reason=f"{marker}: {why}"))


@pytest.fixture
def nats_server(tmp_path: Path):
    """A real nats-server with JetStream on a free loopback port, stopped after the test."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def service_env() -> dict[str, str]:
    """Environment for service subprocesses: JSON logs, no inherited TANDEM_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_LOG_FORMAT"] = "json"
    return env


@pytest.fixture
def exported():
    """Tracing on in this process for one test; its finished spans, kept in memory."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.setup("test", "t1", "", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


@pytest.fixture(scope="module")
def receiver():
    """An OTLP/HTTP receiver (tests/router/otlp_receiver.py) for a module's services: give
    them `receiver.url` as TANDEM_OTLP_ENDPOINT."""
    from tests.router.otlp_receiver import OtlpReceiver

    r = OtlpReceiver().start()
    try:
        yield r
    finally:
        r.stop()
