"""What carries out a decision: log it, start and stop local worker processes, or scale
the Kubernetes Deployments or the roles of a RoleBasedGroup.

Each actuator has `apply(counts, live)`: `counts` is what each role should run, `live`
the ids of the workers of each role whose load reports arrive now; and `stop()`, safe
twice. The decision itself is policy.py's; an actuator only makes it so.
"""

from __future__ import annotations

import abc
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from libs.common.log import get_logger
from services.planner.config import PlannerConfig

log = get_logger(__name__)

REPO = Path(__file__).resolve().parents[2]


class DryRun:
    """Only logs what it would do."""

    name = "dry-run"

    async def apply(self, counts: dict[str, int], live: dict[str, set[str]]) -> None:
        log.info("planner would scale", counts=counts,
                 live={role: len(ids) for role, ids in live.items()})  # fmt: skip

    async def stop(self) -> None:
        pass


class LocalProcesses:
    """Starts `python -m services.<role>` processes on this host and stops them (SIGTERM:
    the worker drains its requests first). Only processes it started, by their pid; the
    workers it did not start (make run's prefill-1, decode-1) count toward the total and
    are never touched. Worker ids are `<role>-p<n>`; with --local-credentials-dir, each
    gets `<dir>/<id>.credentials` (scripts/cluster.py makes them for --planner)."""

    name = "local"

    def __init__(self, config: PlannerConfig, max_workers: dict[str, int]):
        self.config = config
        self.max_workers = max_workers
        self.started: dict[str, dict[str, asyncio.subprocess.Process]] = {
            "prefill": {},
            "decode": {},
        }
        self.leaving: dict[str, asyncio.Task] = {}  # stopped, still draining
        self.ours: set[str] = set()  # every id it started: never counted as another's

    async def apply(self, counts: dict[str, int], live: dict[str, set[str]]) -> None:
        for role, want in counts.items():
            mine = self.started[role]
            for wid in [w for w, p in mine.items() if p.returncode is not None]:
                log.warning("started worker exited", worker=wid, code=mine.pop(wid).returncode)
            others = len(live.get(role, set()) - self.ours)
            while others + len(mine) < want and len(mine) < self.max_workers[role]:
                await self._start(role)
            while others + len(mine) > want and mine:
                self._retire(role)

    async def _start(self, role: str) -> None:
        taken = {*self.started[role], *self.leaving}
        wid = next(f"{role}-p{n}" for n in range(1, 1000) if f"{role}-p{n}" not in taken)
        env = {**os.environ, f"TANDEM_{role.upper()}_NATS_URL": self.config.nats_url}
        creds = Path(self.config.local_credentials_dir or "/nonexistent") / f"{wid}.credentials"
        if creds.exists():
            env[f"TANDEM_{role.upper()}_NATS_CREDENTIALS_FILE"] = str(creds)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"services.{role}", "--service-id", wid,
            "--subject-prefix", self.config.subject_prefix,
            cwd=REPO, env=env, stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.started[role][wid] = proc
        self.ours.add(wid)
        log.info("worker started", worker=wid, pid=proc.pid)

    def _retire(self, role: str) -> None:
        """SIGTERM the newest this actuator started; it leaves once drained."""
        wid = next(reversed(self.started[role]))
        proc = self.started[role].pop(wid)
        log.info("worker stopping", worker=wid, pid=proc.pid)
        task = asyncio.create_task(self._end(wid, proc, self.config.drain_timeout + 30.0))
        self.leaving[wid] = task
        task.add_done_callback(lambda _t: self.leaving.pop(wid, None))

    @staticmethod
    async def _end(wid: str, proc: asyncio.subprocess.Process, grace: float) -> None:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.info("worker stopped", worker=wid, code=proc.returncode)

    async def stop(self) -> None:
        for role in self.started:
            while self.started[role]:
                self._retire(role)
        await asyncio.gather(*list(self.leaving.values()), return_exceptions=True)


class ApiServerActuator(abc.ABC):
    """What the actuators that scale through the Kubernetes API server share: `replicas()`
    reads what runs now (the planner starts from it, not from the workers it hears), and
    the official client is synchronous, so each call runs in a thread, off the event loop."""

    name: str
    api: Any

    @abc.abstractmethod
    async def apply(self, counts: dict[str, int], live: dict[str, set[str]]) -> None: ...

    @abc.abstractmethod
    async def replicas(self) -> dict[str, int]: ...

    async def stop(self) -> None:
        close = getattr(self.api.api_client, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


class KubernetesDeployments(ApiServerActuator):
    """Patches `spec.replicas` of the prefill and decode Deployments through the official
    client's scale subresource (AppsV1Api.patch_namespaced_deployment_scale). Its
    ServiceAccount needs get/patch on deployments/scale (deploy/k8s/base/planner.yaml)."""

    name = "kubernetes"

    def __init__(self, config: PlannerConfig, api: Any = None):
        self.config = config
        self.deployments = {"prefill": config.k8s_prefill_deployment,
                            "decode": config.k8s_decode_deployment}  # fmt: skip
        self.api = api if api is not None else kubernetes_api("AppsV1Api", config.k8s_api)
        self.applied: dict[str, int] = {}  # replicas last read or patched, per role

    async def apply(self, counts: dict[str, int], live: dict[str, set[str]]) -> None:
        for role, n in counts.items():
            if self.applied.get(role) == n:
                continue
            name = self.deployments[role]
            body = {"spec": {"replicas": n}}
            await asyncio.to_thread(self.api.patch_namespaced_deployment_scale, name,
                                    self.config.k8s_namespace, body)  # fmt: skip
            self.applied[role] = n
            log.info("deployment scaled", deployment=name, replicas=n)

    async def replicas(self) -> dict[str, int]:
        out = {}
        for role, name in self.deployments.items():
            scale = await asyncio.to_thread(self.api.read_namespaced_deployment_scale, name,
                                            self.config.k8s_namespace)  # fmt: skip
            out[role] = int(scale.spec.replicas or 0)
        self.applied.update(out)
        return out


RBG = ("workloads.x-k8s.io", "v1alpha2", "rolebasedgroups")  # group, version, plural


class RoleBasedGroupRoles(ApiServerActuator):
    """Sets `replicas` of the prefill and decode roles of one RoleBasedGroup (sgl-project
    rbg, deploy/rbg/group) through CustomObjectsApi. Roles are a list, so it reads the
    group and sends a JSON patch that replaces `/spec/roles/<i>/replicas` of the two roles
    only, each after a `test` of `/spec/roles/<i>/name`: if the roles were reordered in
    between, the API server refuses the whole patch instead of scaling another role (a
    merge patch would replace the whole list). Its ServiceAccount needs get/patch on
    rolebasedgroups (deploy/rbg/kustomization.yaml)."""

    name = "rbg"

    def __init__(self, config: PlannerConfig, api: Any = None):
        self.config = config
        self.roles = {"prefill": config.rbg_prefill_role, "decode": config.rbg_decode_role}
        self.api = api if api is not None else kubernetes_api("CustomObjectsApi", config.k8s_api)

    async def apply(self, counts: dict[str, int], live: dict[str, set[str]]) -> None:
        found = await self._roles()
        patch = []
        for role, n in counts.items():
            i, current = found[role]
            if current != n:
                at = f"/spec/roles/{i}"
                patch += [{"op": "test", "path": f"{at}/name", "value": self.roles[role]},
                          {"op": "replace", "path": f"{at}/replicas", "value": n}]  # fmt: skip
        if not patch:
            return
        await self._call(self.api.patch_namespaced_custom_object, patch,
                         _content_type="application/json-patch+json")  # fmt: skip
        log.info("rolebasedgroup scaled", group=self.config.rbg_name,
                 replicas={self.roles[role]: n for role, n in counts.items()})  # fmt: skip

    async def replicas(self) -> dict[str, int]:
        return {role: n for role, (_i, n) in (await self._roles()).items()}

    async def _roles(self) -> dict[str, tuple[int, int]]:
        """Each of our roles' index in the group's list and its replicas now."""
        group = await self._call(self.api.get_namespaced_custom_object)
        listed = {r.get("name"): (i, int(r.get("replicas", 0)))
                  for i, r in enumerate(group.get("spec", {}).get("roles", []))}  # fmt: skip
        missing = {role: name for role, name in self.roles.items() if name not in listed}
        if missing:
            flags = ", ".join(f"--rbg-{role}-role {name}" for role, name in missing.items())
            raise LookupError(f"RoleBasedGroup {self._where}: no role named as in {flags} "
                              f"(its roles: {', '.join(map(str, listed))})")  # fmt: skip
        return {role: listed[name] for role, name in self.roles.items()}

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        group, version, plural = RBG
        namespace, name = self.config.k8s_namespace, self.config.rbg_name
        try:
            return await asyncio.to_thread(method, group, version, namespace, plural, name,
                                           *args, **kwargs)  # fmt: skip
        except ApiException as e:
            if e.status != 404:
                raise
            raise LookupError(f"RoleBasedGroup {self._where} not found (--rbg-name, "
                              "--k8s-namespace)") from None  # fmt: skip

    @property
    def _where(self) -> str:
        return f"{self.config.k8s_namespace}/{self.config.rbg_name}"


def kubernetes_api(kind: str, host: str) -> Any:
    """The official client's `kind` (AppsV1Api, CustomObjectsApi): at `host` (plain, as a
    test's loopback server), else the in-cluster service account, else ~/.kube/config."""
    from kubernetes import client, config  # only the kubernetes and rbg actuators need it

    if host:
        configuration = client.Configuration()
        configuration.host = host
        return getattr(client, kind)(client.ApiClient(configuration))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return getattr(client, kind)()


def make(config: PlannerConfig) -> DryRun | LocalProcesses | ApiServerActuator:
    if config.actuator == "local":
        return LocalProcesses(config, config.targets.max_workers)
    if config.actuator == "kubernetes":
        return KubernetesDeployments(config)
    if config.actuator == "rbg":
        return RoleBasedGroupRoles(config)
    return DryRun()
