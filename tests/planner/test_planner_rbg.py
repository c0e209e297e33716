"""The rbg actuator through the official client, against a fake API server.

No Kubernetes cluster runs here: a small aiohttp server on loopback answers the two
endpoints the actuator uses (GET and PATCH of a RoleBasedGroup) the way the API server
does for a custom resource: a JSON patch (RFC 6902) is applied whole or not at all, a
failed `test` is a 422; a merge patch (RFC 7386) replaces a list whole; other patch types
are a 415. The group is deploy/rbg/group's, its five roles in their order there.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import orjson
import pytest
import yaml
from aiohttp import web

from services.planner.actuators import RoleBasedGroupRoles
from services.planner.config import PlannerConfig
from tests.deploy.names import REPO
from tests.planner.conftest import (
    Feeder,
    LoopbackApiServer,
    planner_details,
    report,
    wait_for,
)

GROUP = "/apis/workloads.x-k8s.io/v1alpha2/namespaces/{namespace}/rolebasedgroups/{name}"
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"


def shipped_group() -> dict:
    return yaml.safe_load((REPO / "deploy/rbg/group/rolebasedgroup.yaml").read_text())


def replicas_of(group: dict) -> dict[str, int]:
    return {role["name"]: role["replicas"] for role in group["spec"]["roles"]}


class PatchFailed(Exception):
    pass


def json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902's test and replace, on a copy: every op applies or the patch fails."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [
            k.replace("~1", "/").replace("~0", "~") for k in op["path"][1:].split("/")
        ]
        target = doc
        try:
            for key in parents:
                target = target[int(key) if isinstance(target, list) else key]
            key = int(last) if isinstance(target, list) else last
            now = target[key]  # both ops need the path to exist
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise PatchFailed(f"{op['path']}: missing ({e!r})") from None
        if op["op"] == "test" and now != op["value"]:
            raise PatchFailed(f"test {op['path']}: {now!r} is not {op['value']!r}")
        if op["op"] == "replace":
            target[key] = op["value"]
        elif op["op"] != "test":
            raise PatchFailed(f"op {op['op']} is not in this fake")
    return doc


def merge_patch(doc, patch):
    """RFC 7386: objects merge, anything else (a list too) replaces; null removes."""
    if not isinstance(patch, dict):
        return patch
    out = dict(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeApiServer(LoopbackApiServer):
    """RoleBasedGroups by (namespace, name), and `before_patch`: called with the stored
    group before a patch applies (another writer)."""

    route = GROUP

    def __init__(self, groups: dict[tuple[str, str], dict]):
        super().__init__()
        self.groups = copy.deepcopy(groups)
        self.before_patch: Callable[[dict], None] | None = None

    async def get(self, request: web.Request) -> web.Response:
        key = (request.match_info["namespace"], request.match_info["name"])
        if key not in self.groups:
            return self.status(404, f'rolebasedgroups "{key[1]}" not found')
        return web.json_response(self.groups[key])

    async def patch(self, request: web.Request) -> web.Response:
        key = (request.match_info["namespace"], request.match_info["name"])
        if key not in self.groups:
            return self.status(404, f'rolebasedgroups "{key[1]}" not found')
        body = orjson.loads(await request.read())
        self.patches.append((request.path, request.content_type, body))
        if self.before_patch is not None:
            self.before_patch(self.groups[key])
        if request.content_type == JSON_PATCH:
            try:
                self.groups[key] = json_patch(self.groups[key], body)
            except PatchFailed as e:
                return self.status(422, str(e))
        elif request.content_type == MERGE_PATCH:
            self.groups[key] = merge_patch(self.groups[key], body)
        else:
            return self.status(415, f"the media type {request.content_type!r} is not supported")
        return web.json_response(self.groups[key])


@pytest.fixture
async def api():
    server = FakeApiServer({("serving", "tandem"): shipped_group()})
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def actuator(api):
    config = PlannerConfig(actuator="rbg", k8s_api=api.url, k8s_namespace="serving")
    rbg = RoleBasedGroupRoles(config)
    try:
        yield rbg
    finally:
        await rbg.stop()
        await rbg.stop()  # safe twice


def group_with(replicas: dict[str, int]) -> dict:
    group = shipped_group()
    for role in group["spec"]["roles"]:
        role["replicas"] = replicas.get(role["name"], role["replicas"])
    return group


async def test_replicas_reads_the_two_roles_from_the_group(api, actuator):
    assert await actuator.replicas() == {"prefill": 1, "decode": 1}
    api.groups["serving", "tandem"] = group_with({"prefill": 2, "decode": 5})
    assert await actuator.replicas() == {"prefill": 2, "decode": 5}
    assert api.patches == []


async def test_scaling_up_and_down_changes_only_the_two_roles_replicas(api, actuator):
    await actuator.apply({"prefill": 3, "decode": 2}, {})
    assert api.groups["serving", "tandem"] == group_with({"prefill": 3, "decode": 2})
    await actuator.apply({"prefill": 1, "decode": 2}, {})
    assert api.groups["serving", "tandem"] == group_with({"prefill": 1, "decode": 2})
    assert await actuator.replicas() == {"prefill": 1, "decode": 2}
    # One JSON patch a change, naming only the roles whose count changed (prefill is
    # index 2 of the shipped list), each replace after a test of the role's name.
    assert [p[1] for p in api.patches] == [JSON_PATCH, JSON_PATCH]
    assert api.patches[1][2] == [
        {"op": "test", "path": "/spec/roles/2/name", "value": "prefill"},
        {"op": "replace", "path": "/spec/roles/2/replicas", "value": 1},
    ]
    assert (
        api.patches[1][0]
        == "/apis/workloads.x-k8s.io/v1alpha2/namespaces/serving/rolebasedgroups/tandem"
    )


async def test_a_count_the_group_already_has_sends_no_patch(api, actuator):
    await actuator.apply({"prefill": 1, "decode": 1}, {})
    assert api.patches == []


async def test_roles_reordered_between_read_and_patch_fail_the_patch_not_another_role(
    api, actuator
):
    def reorder(group: dict) -> None:  # another writer moves router first: cache-store at 2
        roles = group["spec"]["roles"]
        roles.insert(0, roles.pop())

    api.before_patch = reorder
    before = replicas_of(api.groups["serving", "tandem"])
    with pytest.raises(Exception, match="422"):
        await actuator.apply({"prefill": 4, "decode": 1}, {})
    assert replicas_of(api.groups["serving", "tandem"]) == before


async def test_a_missing_role_is_a_clear_error_naming_the_flag(api):
    config = PlannerConfig(actuator="rbg", k8s_api=api.url, k8s_namespace="serving",
                           rbg_decode_role="generate")  # fmt: skip
    rbg = RoleBasedGroupRoles(config)
    try:
        with pytest.raises(
            LookupError, match=r"serving/tandem: no role .*--rbg-decode-role generate"
        ):
            await rbg.apply({"prefill": 2, "decode": 2}, {})
        with pytest.raises(LookupError, match="--rbg-decode-role generate"):
            await rbg.replicas()
    finally:
        await rbg.stop()
    assert api.patches == []


async def test_a_missing_group_is_a_clear_error_naming_it(api):
    config = PlannerConfig(actuator="rbg", k8s_api=api.url, k8s_namespace="serving",
                           rbg_name="absent")  # fmt: skip
    rbg = RoleBasedGroupRoles(config)
    try:
        with pytest.raises(LookupError, match="RoleBasedGroup serving/absent not found"):
            await rbg.replicas()
    finally:
        await rbg.stop()


def test_the_two_roles_must_differ():
    with pytest.raises(ValueError, match="--rbg-prefill-role/--rbg-decode-role"):
        PlannerConfig(actuator="rbg", rbg_prefill_role="worker", rbg_decode_role="worker")


async def test_the_planner_scales_the_decode_role_from_a_decode_queue(planner_cluster, api):
    _cluster, nc, start = planner_cluster
    feeder = Feeder(nc)
    try:
        await start("planner-g", "--actuator", "rbg", "--k8s-api", api.url,
                    "--k8s-namespace", "serving", "--max-decode", "3")  # fmt: skip
        # 60 sequences at 14 + 4 ms each: a 100 ms ITL fits 21 a worker, so 3.
        feeder.reports = [report("prefill", "prefill-1"),
                          report("decode", "decode-1", running=60, max_running=64)]  # fmt: skip

        async def patched():
            return api.patches

        feeder.start()
        await wait_for(patched, 30, "a patch of the group")
        # It started from the group's replicas (read, not patched): the one patch is the
        # decision, and only decode (index 3) changed; the other four roles are as shipped.
        ((_path, content_type, body),) = api.patches
        assert content_type == JSON_PATCH
        assert body == [
            {"op": "test", "path": "/spec/roles/3/name", "value": "decode"},
            {"op": "replace", "path": "/spec/roles/3/replicas", "value": 3},
        ]
        assert api.groups["serving", "tandem"] == group_with({"decode": 3})
    finally:
        await feeder.stop()


async def test_a_missing_group_is_logged_and_the_planner_keeps_running(
    planner_cluster, api, tmp_path
):
    cluster, nc, start = planner_cluster
    feeder = Feeder(nc)
    log_path = tmp_path / "logs" / "planner-m.log"
    try:
        await start("planner-m", "--actuator", "rbg", "--k8s-api", api.url,
                    "--k8s-namespace", "serving", "--rbg-name", "absent")  # fmt: skip
        feeder.reports = [report("prefill", "prefill-1"), report("decode", "decode-1")]
        feeder.start()

        async def failed_twice():
            return log_path.read_text().count("RoleBasedGroup serving/absent not found") >= 2

        await wait_for(failed_twice, 30, "the missing group logged at two decisions")
        assert (await planner_details(nc, "planner-m"))["actuator"] == "rbg"
    finally:
        await feeder.stop()
    assert cluster.procs["planner-m"].poll() is None
    failures = [json.loads(x) for x in log_path.read_text().splitlines()
                if x.startswith("{") and "planning failed" in x]  # fmt: skip
    assert failures and "LookupError" in failures[0]["exception"]
    assert api.patches == []
