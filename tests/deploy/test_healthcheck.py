"""scripts.healthcheck: finds this host's instance over NATS (with auth), fails clearly."""

import asyncio
import os
from pathlib import Path

import pytest

from libs.common.service import BaseService
from scripts import healthcheck
from scripts.healthcheck import Unhealthy, check, check_nats_service, host_prefix
from scripts.nats_server import NatsServer
from services.cache_master.config import CacheMasterConfig


@pytest.fixture
def auth_nats(tmp_path: Path):
    """A nats-server with user/password auth, as compose runs it."""
    server = NatsServer(tmp_path / "nats", extra_args=["--user", "u", "--pass", "s3cret"]).start()
    try:
        yield server
    finally:
        server.stop()


def _url(server: NatsServer, password: str = "s3cret") -> str:
    return f"nats://u:{password}@127.0.0.1:{server.port}"


async def _running(config: CacheMasterConfig) -> BaseService:
    service = BaseService(config)  # the shared lifecycle registers tandem-cache_master + info
    await service.start()
    return service


async def test_default_id_instance_of_this_host_is_found_through_authenticated_nats(auth_nats):
    config = CacheMasterConfig(nats_url=_url(auth_nats))
    assert config.service_id.startswith(host_prefix("cache_master"))
    service = await _running(config)
    try:
        report = await asyncio.to_thread(check_nats_service, config, False, 3.0)
        assert config.service_id in report
    finally:
        await service.stop()


async def test_explicit_service_id_is_asked_directly(auth_nats):
    config = CacheMasterConfig(nats_url=_url(auth_nats), service_id="master-7")
    service = await _running(config)
    try:
        env = {"TANDEM_NATS_URL": _url(auth_nats), "TANDEM_CACHE_MASTER_SERVICE_ID": "master-7"}
        report = await asyncio.to_thread(check, "cache_master", env, 3.0)
        assert "tandem.cache_master.master-7.info" in report
    finally:
        await service.stop()


async def test_instance_of_another_host_does_not_make_this_one_healthy(auth_nats):
    config = CacheMasterConfig(nats_url=_url(auth_nats))
    service = await _running(config)
    try:
        with pytest.raises(Unhealthy, match="no tandem-cache_master instance of this host"):
            await asyncio.to_thread(check_nats_service, config, False, 2.0, "other-host")
    finally:
        await service.stop()


def test_wrong_password_is_unhealthy(auth_nats):
    config = CacheMasterConfig(nats_url=_url(auth_nats, password="wrong"))
    with pytest.raises(Unhealthy, match=r"(?i)authorization"):
        check_nats_service(config, False, 2.0)


def test_unreachable_nats_is_unhealthy():
    config = CacheMasterConfig(nats_url="nats://127.0.0.1:1")
    with pytest.raises(Unhealthy, match="cannot reach NATS"):
        check_nats_service(config, False, 1.0)


def test_nats_check_reads_the_monitoring_endpoint(auth_nats):
    env = {"NATS_MONITOR_PORT": str(auth_nats.monitor_port)}
    assert ": 200" in check("nats", env, 3.0)


def test_main_exits_1_with_the_reason_on_stderr(monkeypatch, capsys):
    for name in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_ROUTER_PORT", "1")  # nothing listens there
    assert healthcheck.main(["router", "--timeout", "1"]) == 1
    assert "unhealthy: http://127.0.0.1:1/health" in capsys.readouterr().err


async def test_a_service_identity_checks_its_own_health_under_permissions(tmp_path):
    """As compose and k8s run it: one identity per role, its credentials in a file; the
    check asks as that identity (discovery and info) and reads its own inbox only."""
    from scripts.identities import AUTH_CONF, Identity, ensure

    files = ensure(tmp_path / "secrets", [Identity("cache_master", "cache_master")])
    server = NatsServer(tmp_path / "nats", config_file=tmp_path / "secrets" / AUTH_CONF).start()
    url = f"nats://127.0.0.1:{server.port}"
    config = CacheMasterConfig(nats_url=url, nats_credentials_file=str(files["cache_master"]))
    service = await _running(config)
    try:
        report = await asyncio.to_thread(check_nats_service, config, False, 3.0)
        assert config.service_id in report
        env = {"TANDEM_NATS_URL": url, "TANDEM_NATS_CREDENTIALS_FILE": str(files["cache_master"])}
        env["TANDEM_CACHE_MASTER_SERVICE_ID"] = config.service_id
        assert config.service_id in await asyncio.to_thread(check, "cache_master", env, 3.0)
        with pytest.raises(Unhealthy, match=r"(?i)authorization"):
            check_nats_service(CacheMasterConfig(nats_url=url), False, 2.0)
    finally:
        await service.stop()
        server.stop()
