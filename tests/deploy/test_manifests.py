"""Every kustomization renders (`kubectl kustomize`) to resources a cluster would accept:
Kubernetes kinds against their published schemas (kubernetes-validate, strict), the
RoleBasedGroup against the fields its CRD documents (our schema, jsonschema). And the
validator rejects what a cluster would: misspelled fields, wrong types, unknown kinds."""

from __future__ import annotations

import copy
import importlib.metadata
import json

import pytest
import yaml

from tests.deploy.manifests import (
    DEPLOY,
    KUBERNETES_VERSION,
    RBG_SCHEMA,
    kustomizations,
    rendered,
    resource_errors,
)
from tests.deploy.names import REPO

BASE = DEPLOY / "k8s" / "base"
SHIPPED = {"deploy/k8s/base", "deploy/k8s/overlays/gpu", "deploy/rbg", "deploy/rbg/group"}


def _router_deployment() -> dict:
    docs = yaml.safe_load_all((BASE / "router.yaml").read_text())
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return deployment


def _small_group() -> dict:
    """deploy/rbg's RoleBasedGroup with the router's pod template in every role (offline)."""
    group = yaml.safe_load((DEPLOY / "rbg" / "group" / "rolebasedgroup.yaml").read_text())
    template = _router_deployment()["spec"]["template"]
    for role in group["spec"]["roles"]:
        role["standalonePattern"] = {"template": copy.deepcopy(template)}
    return group


def test_the_search_finds_every_kustomization_we_ship():
    assert SHIPPED <= set(kustomizations())


@pytest.mark.parametrize("folder", kustomizations())
def test_kustomization_renders_to_resources_a_cluster_accepts(folder):
    docs = rendered()[folder]
    assert docs, f"{folder} rendered nothing"
    errors = {f"{d['kind']}/{d['metadata']['name']}": resource_errors(d) for d in docs}
    errors = {name: e for name, e in errors.items() if e}
    assert not errors, f"{folder} (Kubernetes {KUBERNETES_VERSION}): {errors}"


@pytest.mark.parametrize(
    "name", yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
)
def test_base_files_are_valid_as_written_even_without_kubectl(name):
    for doc in yaml.safe_load_all((BASE / name).read_text()):
        assert not resource_errors(doc), (name, doc["kind"])


def test_the_router_deployment_and_the_small_group_are_valid():
    """The fixtures below are valid, so each rejection is the one change's doing."""
    assert resource_errors(_router_deployment()) == []
    assert resource_errors(_small_group()) == []


def test_a_misspelled_field_of_a_kubernetes_resource_is_rejected():
    deployment = _router_deployment()
    deployment["spec"]["template"]["spec"]["containers"][0]["imagee"] = "tandem"
    assert any("imagee" in e for e in resource_errors(deployment))


def test_a_wrong_type_in_a_kubernetes_resource_is_rejected():
    deployment = _router_deployment()
    deployment["spec"]["replicas"] = "two"
    assert any("replicas" in e for e in resource_errors(deployment))


def test_a_kind_without_a_schema_is_an_error_not_a_pass():
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert resource_errors(widget)


def test_a_misspelled_rolebasedgroup_field_is_rejected():
    group = _small_group()
    group["spec"]["roles"][1]["rolloutStrategy"]["rollingUpdate"]["maxUnavaliable"] = 1
    assert any("maxUnavaliable" in e for e in resource_errors(group))


def test_a_misspelled_field_in_a_roles_pod_template_is_rejected():
    group = _small_group()
    group["spec"]["roles"][0]["standalonePattern"]["template"]["spec"]["containers"][0][
        "livenessProbee"
    ] = {}
    errors = resource_errors(group)
    assert any(e.startswith("spec.roles.0.standalonePattern.") and "livenessProbee" in e
               for e in errors), errors  # fmt: skip


def test_an_update_type_the_crd_does_not_document_is_rejected():
    group = _small_group()
    group["spec"]["roles"][1]["rolloutStrategy"]["rollingUpdate"]["type"] = "InPlace"
    assert any("InPlace'" in e for e in resource_errors(group))


def test_repeated_role_names_are_rejected():
    group = _small_group()
    group["spec"]["roles"][1]["name"] = group["spec"]["roles"][0]["name"]
    assert any("repeat" in e for e in resource_errors(group))


def test_the_rolebasedgroup_schema_names_its_source_and_is_closed():
    schema = json.loads(RBG_SCHEMA.read_text())
    assert "sgl-project/rbg at commit " in schema["$comment"]
    open_objects = []

    def walk(node, path):
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                open_objects.append(path)
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(schema, "")
    assert open_objects == [], "objects of the CRD that are closed must say so"


def test_kubernetes_validate_is_pinned_and_installed_at_the_pin():
    lines = (REPO / "requirements" / "test.txt").read_text().splitlines()
    (pin,) = [line for line in lines if line.startswith("kubernetes-validate==")]
    assert importlib.metadata.version("kubernetes-validate") == pin.split("==")[1]
