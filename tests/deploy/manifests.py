"""The manifests as a cluster would read them, offline: every kustomization in the repo
rendered by `kubectl kustomize` (kustomize built in), and one validator for what it yields.

- Kubernetes kinds: kubernetes-validate, strict (an unknown field is an error), against the
  published schemas of KUBERNETES_VERSION.
- The RoleBasedGroup (sgl-project/rbg's CRD, which kubernetes-validate does not know): our
  schema of the CRD fields deploy/rbg uses (deploy/rbg/rolebasedgroup.schema.json, with
  jsonschema), and each role's pod template as a core/v1 PodTemplate (kubernetes-validate).
- A kind neither knows is an error: nothing passes unchecked.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from scripts.identities import ensure
from tests.deploy.names import REPO

DEPLOY = REPO / "deploy"
# kubectl here is v1.32 (kustomize v5.5.0): the schemas of the same minor version.
KUBERNETES_VERSION = "1.32.0"
RBG_API_VERSION = "workloads.x-k8s.io/v1alpha2"
RBG_SCHEMA = DEPLOY / "rbg" / "rolebasedgroup.schema.json"
KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
# Folders of the repo root no kustomization lives in (models, run state, wheels), skipped by
# the search along with hidden folders (.venv, .git) and caches anywhere.
_SKIP_TOP = {"models", "run", "bench/results", "deploy/wheels"}
_SKIP_ANY = {"__pycache__", "node_modules"}


def kustomizations() -> list[str]:
    """Every folder of the repo that holds a kustomization, relative to the repo root."""
    found = []
    for folder, subfolders, files in os.walk(REPO):
        here = Path(folder).relative_to(REPO)
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in _SKIP_ANY
                         and (here / d).as_posix() not in _SKIP_TOP]  # fmt: skip
        if any(name in files for name in KUSTOMIZATION_NAMES):
            found.append(here.as_posix())
    return sorted(found)


def require_kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl (kustomize built in) is not installed: manifests not rendered")
    return path


@functools.cache
def rendered() -> dict[str, list[dict]]:
    """Each kustomization's resources as `kubectl kustomize` yields them (folder -> docs).

    Rendered from a copy of deploy/ whose secrets folder is made by scripts.identities, as an
    operator does before the first apply (the real one is git-ignored and may be absent).
    """
    kubectl = require_kubectl()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        copy_of = Path(tmp) / "deploy"
        shutil.copytree(DEPLOY, copy_of, ignore=shutil.ignore_patterns("secrets", "wheels"))
        ensure(copy_of / "k8s" / "base" / "secrets")
        for folder in kustomizations():
            if not folder.startswith("deploy/"):
                raise AssertionError(f"{folder}: a kustomization outside deploy/ is not rendered")
            build = subprocess.run([kubectl, "kustomize", str(Path(tmp) / folder)],
                                   capture_output=True, text=True, timeout=120)  # fmt: skip
            if build.returncode != 0:
                raise AssertionError(f"kubectl kustomize {folder}: {build.stderr}")
            out[folder] = [d for d in yaml.safe_load_all(build.stdout) if d]
    return out


@functools.cache
def _rbg_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(RBG_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _where(path) -> str:
    return ".".join(str(p) for p in path) or "(top)"


def _kubernetes_errors(resource: dict) -> list[str]:
    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_where(e.path)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"no schema: {e.message}"]
    return []


def _rbg_errors(resource: dict) -> list[str]:
    errors = [f"{_where(e.path)}: {e.message}" for e in _rbg_validator().iter_errors(resource)]
    if errors:
        return errors
    names = [role["name"] for role in resource["spec"]["roles"]]
    if len(names) != len(set(names)):  # the CRD's roles are a list-map keyed by name
        errors.append(f"spec.roles: role names repeat: {names}")
    for i, role in enumerate(resource["spec"]["roles"]):
        template = role.get("standalonePattern", {}).get("template")
        if template is None:
            errors.append(f"spec.roles.{i}: no standalonePattern.template")
            continue
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role["name"]}}
        pod["template"] = copy.deepcopy(template)
        where = f"spec.roles.{i}.standalonePattern."
        errors += [where + e for e in _kubernetes_errors(pod)]
    return errors


def resource_errors(resource: dict) -> list[str]:
    """Why a cluster would refuse `resource` ([] if it would take it): the one validator."""
    if resource.get("apiVersion") == RBG_API_VERSION and resource.get("kind") == "RoleBasedGroup":
        return _rbg_errors(resource)
    return _kubernetes_errors(resource)
