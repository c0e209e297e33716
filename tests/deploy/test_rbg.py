"""deploy/rbg runs Tandem's five roles as one RoleBasedGroup (issue 26): the same pods as
deploy/k8s/base (image, command, variables, probes, identities, secrets), the base's
ConfigMaps, Secrets, NATS and Services, and stores updated in place with their segment and
SSD files on a volume that lives as long as the pod. Checked on `kubectl kustomize` output."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from services.cache_store.config import parse_size
from services.planner.actuators import RBG
from services.planner.config import PlannerConfig
from tests.deploy.manifests import rendered
from tests.deploy.test_k8s_store import _bytes

ROLES = {"router", "prefill", "decode", "cache-master", "cache-store"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


@pytest.fixture(scope="module")
def out() -> list[dict]:
    return rendered()["deploy/rbg"]


@pytest.fixture(scope="module")
def roles(out) -> dict[str, dict]:
    (group,) = [d for d in out if d["kind"] == "RoleBasedGroup"]
    return {role["name"]: role for role in group["spec"]["roles"]}


def _pod(role: dict) -> dict:
    return role["standalonePattern"]["template"]["spec"]


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_group_runs_the_five_roles_in_place_of_the_base_workloads(out, roles):
    assert set(roles) == ROLES
    workloads = {d["metadata"]["name"] for d in out if d["kind"] in WORKLOAD_KINDS}
    # NATS and the planner stay as in deploy/k8s (the planner scales the group); no role
    # runs twice.
    assert workloads == {"nats", "planner"}
    base = {d["metadata"]["name"] for d in rendered()["deploy/k8s/base"]
            if d["kind"] in WORKLOAD_KINDS}  # fmt: skip
    assert base - {"nats", "planner"} == ROLES


def test_the_planner_scales_the_groups_roles_and_may_get_and_patch_only_the_group(out):
    (group,) = [d for d in out if d["kind"] == "RoleBasedGroup"]
    (planner,) = [
        d for d in out if d["kind"] == "Deployment" and d["metadata"]["name"] == "planner"
    ]
    pod = planner["spec"]["template"]["spec"]
    env = _env(pod["containers"][0])
    assert env["TANDEM_PLANNER_ACTUATOR"] == "rbg"
    # What it names (its variables, else the flags' defaults): this group, and the roles
    # that run the prefill and decode pods; the actuator's group/version is the group's.
    config = PlannerConfig()

    def flag(field: str) -> str:
        return env.get(f"TANDEM_PLANNER_{field.upper()}") or getattr(config, field)

    name = flag("rbg_name")
    assert name == group["metadata"]["name"]
    assert (flag("rbg_prefill_role"), flag("rbg_decode_role")) == ("prefill", "decode")
    rbg_group, version, plural = RBG
    assert group["apiVersion"] == f"{rbg_group}/{version}"
    # Its ServiceAccount's only rights: get and patch this one RoleBasedGroup.
    bindings = [d for d in out if d["kind"] == "RoleBinding"
                and {"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                     "namespace": planner["metadata"]["namespace"]} in d["subjects"]]  # fmt: skip
    rules = [rule for b in bindings for d in out
             if d["kind"] == "Role" and d["metadata"]["name"] == b["roleRef"]["name"]
             for rule in d["rules"]]  # fmt: skip
    assert rules == [{"apiGroups": [rbg_group], "resources": [plural], "resourceNames": [name],
                      "verbs": ["get", "patch"]}]  # fmt: skip


def test_each_role_runs_the_pod_of_its_base_workload(roles):
    """Only the store's data volume differs: the base's claim becomes a pod volume."""
    base = {d["metadata"]["name"]: d for d in rendered()["deploy/k8s/base"]
            if d["kind"] in WORKLOAD_KINDS}  # fmt: skip
    for name, role in roles.items():
        template = copy.deepcopy(role["standalonePattern"]["template"])
        if name == "cache-store":
            pod = template["spec"]
            pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "data"]
            del pod["containers"][0]["resources"]["requests"]["ephemeral-storage"]
        assert template == base[name]["spec"]["template"], name


def test_stores_update_in_place_with_segment_and_ssd_on_a_pod_volume(roles):
    store = roles["cache-store"]
    update = store["rolloutStrategy"]["rollingUpdate"]
    assert update["type"] == "InPlaceIfPossible" and update["maxUnavailable"] == 1
    pod = _pod(store)
    (container,) = pod["containers"]
    env = _env(container)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = mounts[str(Path(env["TANDEM_CACHE_STORE_SEGMENT_FILE"]).parent)]
    assert mounts[str(Path(env["TANDEM_CACHE_STORE_SSD_DIR"]).parent)] == volume
    (data,) = [v for v in pod["volumes"] if v["name"] == volume]
    # An emptyDir on disk lives with the pod: an in-place update restarts the container in
    # the same pod and keeps it (a memory-backed one would count against the pod's memory).
    assert set(data) == {"name", "emptyDir"} and "medium" not in data["emptyDir"]
    need = parse_size(env["TANDEM_CACHE_STORE_SEGMENT_SIZE"])
    need += parse_size(env["TANDEM_CACHE_STORE_SSD_SIZE"])
    assert _bytes(data["emptyDir"]["sizeLimit"]) >= need
    assert _bytes(container["resources"]["requests"]["ephemeral-storage"]) >= need
    # The store's id is its pod's name, which an in-place update keeps.
    assert "TANDEM_CACHE_STORE_SERVICE_ID" in env


@pytest.mark.parametrize("name", sorted(ROLES))
def test_every_mount_names_a_volume_of_its_pod(roles, name):
    pod = _pod(roles[name])
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for container in pod["containers"]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{name}: {mount['mountPath']}"


def test_two_masters_updated_one_at_a_time(roles):
    master = roles["cache-master"]
    assert master["replicas"] >= 2
    assert master["rolloutStrategy"]["rollingUpdate"]["maxUnavailable"] == 1


def test_dependencies_start_the_roles_in_the_compose_order(roles):
    """nats -> cache_master -> stores -> prefill, decode -> router (docs/deployment.md)."""
    started: list[set[str]] = []
    left = {name: set(role.get("dependencies", [])) for name, role in roles.items()}
    assert all(deps <= ROLES for deps in left.values())
    while left:
        ready = {name for name, deps in left.items() if not deps - set().union(*started)}
        assert ready, f"a dependency cycle among {sorted(left)}"
        started.append(ready)
        left = {name: deps for name, deps in left.items() if name not in ready}
    assert started == [{"cache-master"}, {"cache-store"}, {"prefill", "decode"}, {"router"}]


def test_the_groups_pods_use_the_generated_config_and_secrets(out, roles):
    names = {d["kind"]: set() for d in out}
    for d in out:
        names[d["kind"]].add(d["metadata"]["name"])
    for name, role in roles.items():
        pod = _pod(role)
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in names["ConfigMap"], name
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in names["Secret"], name


def test_base_services_and_budget_select_the_groups_pods(out, roles):
    labels = {name: _pod_labels(role) for name, role in roles.items()}
    for d in out:
        if d["kind"] == "Service" and not d["metadata"]["name"].startswith("nats"):
            selector = d["spec"]["selector"]
        elif d["kind"] == "PodDisruptionBudget":
            selector = d["spec"]["selector"]["matchLabels"]
        else:
            continue
        selected = [n for n, lab in labels.items() if selector.items() <= lab.items()]
        assert selected, f"{d['kind']}/{d['metadata']['name']} selects none of the roles"
        for port in d["spec"].get("ports", []):
            pods = [_pod(roles[n]) for n in selected]
            names = {p["name"] for pod in pods for c in pod["containers"] for p in c["ports"]}
            assert port["targetPort"] in names, d["metadata"]["name"]


def _pod_labels(role: dict) -> dict[str, str]:
    return role["standalonePattern"]["template"]["metadata"]["labels"]
