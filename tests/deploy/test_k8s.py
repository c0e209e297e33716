"""deploy/k8s (kustomize) names only what exists: image, commands, flags, ports, probes.

Offline and without a cluster: these checks read the YAML the way kustomize would use it
(resources, generators, patches by kind and name); test_manifests.py renders it with
`kubectl kustomize` and validates what comes out against Kubernetes' schemas.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from scripts.healthcheck import SERVICES
from scripts.identities import ensure
from scripts.nats_server import nats_server_binary
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


def test_every_secret_is_a_file_that_scripts_identities_makes(tmp_path):
    """No literal secrets: each Secret's files come from `python -m scripts.identities
    deploy/k8s/base/secrets` (git-ignored), which makes exactly these names."""
    made = set(ensure(tmp_path / "secrets").values()) | set((tmp_path / "secrets").iterdir())
    made_names = {p.name for p in made}
    generators = _kustomization(BASE)["secretGenerator"]
    for gen in generators:
        assert "literals" not in gen and "envs" not in gen, gen["name"]
        for entry in gen["files"]:
            path = entry.split("=", 1)[-1]
            assert path.startswith("secrets/") and Path(path).name in made_names, entry
    assert "/deploy/k8s/base/secrets/" in (REPO / ".gitignore").read_text().splitlines()


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


def _secret_volumes(workload: dict) -> dict[str, str]:
    """mount path -> Secret name, for the Secret volumes of the workload's containers."""
    pod = workload["spec"]["template"]["spec"]
    secrets = {
        v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v
    }
    return {
        m["mountPath"]: secrets[m["name"]]
        for c in _containers(workload)
        for m in c.get("volumeMounts", [])
        if m["name"] in secrets
    }


@pytest.mark.parametrize("name", sorted(set(WORKLOADS) - {"nats"}))
def test_each_role_mounts_only_its_own_identity_and_workers_the_kv_secret(name):
    workload = WORKLOADS[name]
    (container,) = _containers(workload)
    role = _role(container)
    mounted = _secret_volumes(workload)
    assert mounted.pop("/etc/tandem/nats") == f"nats-{role.replace('_', '-')}"
    kv = _env(container).get(f"TANDEM_{role.upper()}_KV_SECRET_FILE", {}).get("value")
    if role in ("prefill", "decode"):
        assert mounted.pop("/etc/tandem/kv") == "kv-secret"
        assert kv == "/etc/tandem/kv/kv.secret"
    assert not mounted and (kv is None) == (role not in ("prefill", "decode"))
    env = _tandem_env_file()
    assert env["TANDEM_NATS_URL"] == "nats://nats:4222"  # no userinfo, no password
    assert env["TANDEM_NATS_CREDENTIALS_FILE"] == "/etc/tandem/nats/credentials"
    assert not {"NATS_USER", "NATS_PASSWORD", "TANDEM_NATS_URL"} & set(_env(container))
    fs_group = workload["spec"]["template"]["spec"]["securityContext"]["fsGroup"]
    assert fs_group == workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"]


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


def test_nats_cluster_routes_match_the_statefulset_and_log_in():
    nats = WORKLOADS["nats"]
    conf = (BASE / "nats.conf").read_text()
    (container,) = _containers(nats)
    env = _env(container)
    routes = [env[v]["value"] for v in re.findall(r"\$(NATS_ROUTE_\d+)", conf)]
    found = [re.fullmatch(r"nats-route://route:\$\(NATS_ROUTE_PASSWORD\)@(nats-\d+)\.(\S+):6222", r)
             for r in routes]  # fmt: skip
    assert all(found) and len(found) == nats["spec"]["replicas"] == 3
    assert {m.group(1) for m in found} == {f"nats-{i}" for i in range(3)}
    assert {m.group(2) for m in found} == {nats["spec"]["serviceName"]}
    names = list(env)  # $(VAR) expands only entries defined earlier
    assert all(names.index("NATS_ROUTE_PASSWORD") < names.index(v) for v in env if v[-1].isdigit())
    secret = env["NATS_ROUTE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "nats-auth", "key": "route.password"}
    cluster = conf[conf.index("cluster {") :]
    assert re.search(r"authorization \{\s*user: route\s*password: \$NATS_ROUTE_PASSWORD", cluster)
    assert "jetstream" in conf and "include ./nats-auth.conf" in conf
    assert container["command"] == ["nats-server", "--config", "/etc/nats/nats.conf"]


def test_nats_conf_with_generated_users_is_valid_for_nats_server(tmp_path):
    ensure(tmp_path / "secrets")
    (tmp_path / "nats.conf").write_text((BASE / "nats.conf").read_text())
    (tmp_path / "nats-auth.conf").write_text((tmp_path / "secrets" / "nats-auth.conf").read_text())
    route = "nats-route://route:pw@nats-{}.nats-headless:6222"
    env = {"POD_NAME": "nats-0", "NATS_ROUTE_PASSWORD": "pw", "PATH": os.environ["PATH"]}
    env |= {f"NATS_ROUTE_{i}": route.format(i) for i in range(3)}
    check = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"],
                           env=env, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    projected = WORKLOADS["nats"]["spec"]["template"]["spec"]["volumes"][0]["projected"]
    (secret,) = [s["secret"] for s in projected["sources"] if "secret" in s]
    assert secret["name"] == "nats-auth" and secret["items"][0]["path"] == "nats-auth.conf"


def test_monitoring_is_not_exposed_by_a_service():
    for svc in (d for d in DOCS if d["kind"] == "Service"):
        ports = {p.get("targetPort") for p in svc["spec"].get("ports", [])}
        assert "monitor" not in ports and 8222 not in ports, svc["metadata"]["name"]


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


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl (its built-in kustomize) not here")
def test_kustomize_builds_with_generated_secrets_and_rewrites_every_reference(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(BASE, base, ignore=shutil.ignore_patterns("secrets"))
    ensure(base / "secrets")
    built = subprocess.run(["kubectl", "kustomize", str(base)], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert len(secrets) == len(_kustomization(BASE)["secretGenerator"])
    text = built.stdout
    refs = set(re.findall(r"secretName: (\S+)", text))  # volumes
    refs |= set(re.findall(r"- secret:\n\s+items: .*\n(?:.*\n)*?\s+name: (\S+)", text))
    refs |= {m for m in re.findall(r"secretKeyRef:\n(?:\s+\w+: .*\n)*?\s+name: (\S+)", text)}
    assert refs <= secrets, refs - secrets  # every reference got the generated name
    assert {r for r in secrets if not r.startswith("nats-cli-")} <= refs  # and each is used
    # none left unhashed (a suffix may be all letters: compare names, not a pattern)
    unhashed = {g["name"] for g in _kustomization(BASE)["secretGenerator"]}
    assert not refs & unhashed, refs & unhashed
