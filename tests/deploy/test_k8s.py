"""deploy/k8s (kustomize) names only what exists: image, commands, flags, ports, probes.

Offline: no cluster and no kustomize binary here, so the checks read the YAML the way
kustomize would use it (resources, generators, patches by kind and name).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from scripts.healthcheck import SERVICES
from tests.deploy.names import REPO, env_vars, service_module, shared_env_vars

K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
GPU = K8S / "overlays" / "gpu"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def _kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def _docs(folder: Path) -> list[dict]:
    docs = []
    for name in _kustomization(folder).get("resources", []):
        path = folder / name
        if path.is_dir():
            continue  # another kustomization (an overlay's base)
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _docs(BASE)
WORKLOADS = {d["metadata"]["name"]: d for d in DOCS if d["kind"] in WORKLOAD_KINDS}


def _containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def _role(container: dict) -> str | None:
    return service_module(container.get("args") or container.get("command"))


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _tandem_env_file() -> dict[str, str]:
    lines = (BASE / "tandem.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_every_file_the_kustomizations_name_exists():
    for folder in (BASE, GPU):
        k = _kustomization(folder)
        for name in k.get("resources", []):
            assert (folder / name).exists(), f"{folder}: {name}"
        for patch in k.get("patches", []):
            assert (folder / patch["path"]).is_file(), f"{folder}: {patch}"
        for gen in k.get("configMapGenerator", []):
            for name in gen.get("envs", []) + gen.get("files", []):
                assert (folder / name).is_file(), f"{folder}: {name}"
        assert [i["name"] for i in k["images"]] == ["tandem"]


def test_one_workload_per_role_plus_nats():
    roles = {_role(c) for w in WORKLOADS.values() for c in _containers(w)} - {None}
    assert roles == set(SERVICES)
    assert WORKLOADS["nats"]["kind"] == "StatefulSet"
    assert WORKLOADS["cache-store"]["kind"] == "StatefulSet"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_container_runs_the_one_image_and_a_real_command(name):
    for container in _containers(WORKLOADS[name]):
        assert container["image"] == "tandem"  # rewritten by the kustomization's `images`
        role = _role(container)
        if role is None:
            assert container["command"][0] == "nats-server", name
        else:
            assert (REPO / "services" / role / "__main__.py").is_file()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_tandem_variable_is_a_flag_of_the_container_service(name):
    for container in _containers(WORKLOADS[name]):
        role = _role(container)
        names = {n for n in _env(container) if n.startswith("TANDEM_")}
        if role is None:
            assert not names
            continue
        wrong = names - env_vars(role)
        assert not wrong, f"{name}: not flags of services.{role}: {sorted(wrong)}"


def test_shared_config_names_only_flags():
    wrong = set(_tandem_env_file()) - shared_env_vars()
    assert not wrong, f"tandem.env: not TANDEM_<FLAG> of any service: {sorted(wrong)}"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_nats_url_uses_the_secret_defined_before_it(name):
    for container in _containers(WORKLOADS[name]):
        env = container.get("env", [])
        names = [e["name"] for e in env]
        if "TANDEM_NATS_URL" not in names:
            assert _role(container) is None
            continue
        url = env[names.index("TANDEM_NATS_URL")]["value"]
        assert url == "nats://$(NATS_USER):$(NATS_PASSWORD)@nats:4222"
        for var in ("NATS_USER", "NATS_PASSWORD"):  # $(VAR) expands only earlier entries
            assert names.index(var) < names.index("TANDEM_NATS_URL")
            assert env[names.index(var)]["valueFrom"]["secretKeyRef"]["name"] == "nats-auth"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_probes_check_this_container(name):
    for container in _containers(WORKLOADS[name]):
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        probes = [container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert container.get("readinessProbe") and container.get("livenessProbe"), name
        for probe in filter(None, probes):
            if "exec" in probe:
                command = probe["exec"]["command"]
                assert command[:3] == ["python", "-m", "scripts.healthcheck"]
                assert command[3] == _role(container), name
            else:
                assert probe["httpGet"]["port"] in ports, name


def test_services_target_ports_their_pods_have():
    for svc in (d for d in DOCS if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [
            w
            for w in WORKLOADS.values()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"service {svc['metadata']['name']} selects nothing"
        for port in svc["spec"].get("ports", []):
            names = {p["name"] for w in pods for c in _containers(w) for p in c.get("ports", [])}
            assert port["targetPort"] in names, svc["metadata"]["name"]


def test_router_listens_where_its_service_points():
    (router,) = _containers(WORKLOADS["router"])
    env = _env(router)
    assert env["TANDEM_ROUTER_HOST"]["value"] == "0.0.0.0"
    port = int(env["TANDEM_ROUTER_PORT"]["value"])
    assert [p["containerPort"] for p in router["ports"]] == [port]


def test_stores_have_stable_ids_volumes_and_a_disruption_budget():
    store = WORKLOADS["cache-store"]
    (container,) = _containers(store)
    env = _env(container)
    assert env["TANDEM_CACHE_STORE_SERVICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(env["TANDEM_CACHE_STORE_SEGMENT_FILE"]["value"]).parent) in mounts
    assert [t["metadata"]["name"] for t in store["spec"]["volumeClaimTemplates"]] == ["data"]
    (pdb,) = [d for d in DOCS if d["kind"] == "PodDisruptionBudget"]
    labels = store["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_workers_advertise_their_pod_ip_for_kv_transfers():
    for role in ("prefill", "decode"):
        (container,) = _containers(WORKLOADS[role])
        host = _env(container)[f"TANDEM_{role.upper()}_TRANSFER_HOST"]
        assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_nats_cluster_routes_match_the_statefulset():
    nats = WORKLOADS["nats"]
    conf = (BASE / "nats.conf").read_text()
    routes = re.findall(r"nats-route://(nats-\d+)\.(\S+?):6222", conf)
    assert len(routes) == nats["spec"]["replicas"] == 3
    assert {svc for _, svc in routes} == {nats["spec"]["serviceName"]}
    assert "jetstream" in conf and "$NATS_USER" in conf and "$NATS_PASSWORD" in conf
    (container,) = _containers(nats)
    assert container["command"] == ["nats-server", "--config", "/etc/nats/nats.conf"]
    assert {"POD_NAME", "NATS_USER", "NATS_PASSWORD"} <= set(_env(container))


def test_gpu_overlay_patches_real_workloads_with_gpus_and_rdma():
    k = _kustomization(GPU)
    assert k["resources"] == ["../../base"]
    patched = {}
    for patch in k["patches"]:
        doc = yaml.safe_load((GPU / patch["path"]).read_text())
        target = WORKLOADS[doc["metadata"]["name"]]
        assert doc["kind"] == target["kind"]
        for container in doc["spec"]["template"]["spec"]["containers"]:
            (base,) = [c for c in _containers(target) if c["name"] == container["name"]]
            wrong = set(_env(container)) - env_vars(_role(base))
            assert not wrong, patch["path"]
            assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
            patched[doc["metadata"]["name"]] = container["resources"]["limits"]
    for role in ("prefill", "decode"):
        assert patched[role]["nvidia.com/gpu"] == 1
    assert all(any(r.startswith("rdma/") for r in limits) for limits in patched.values())
