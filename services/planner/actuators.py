"""What carries out a decision: log it, start and stop local worker processes, or scale
the Kubernetes Deployments.

Each actuator has `apply(counts, live)`: `counts` is what each role should run, `live`
the ids of the workers of each role whose load reports arrive now; and `stop()`, safe
twice. The decision itself is policy.py's; an actuator only makes it so.
"""

from __future__ import annotations

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


class KubernetesDeployments:
    """Patches `spec.replicas` of the prefill and decode Deployments through the official
    client's scale subresource (AppsV1Api.patch_namespaced_deployment_scale). The client
    is synchronous: each call runs in a thread, off the event loop. Its ServiceAccount
    needs get/patch on deployments/scale (deploy/k8s/base/planner.yaml)."""

    name = "kubernetes"

    def __init__(self, config: PlannerConfig, api: Any = None):
        self.config = config
        self.deployments = {"prefill": config.k8s_prefill_deployment,
                            "decode": config.k8s_decode_deployment}  # fmt: skip
        self.api = api if api is not None else apps_api(config.k8s_api)
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

    async def stop(self) -> None:
        close = getattr(self.api.api_client, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


def apps_api(host: str) -> Any:
    """An AppsV1Api: at `host` (plain, as a test's loopback server), else the in-cluster
    service account, else ~/.kube/config."""
    from kubernetes import client, config  # only the kubernetes actuator needs it

    if host:
        configuration = client.Configuration()
        configuration.host = host
        return client.AppsV1Api(client.ApiClient(configuration))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.AppsV1Api()


def make(config: PlannerConfig) -> DryRun | LocalProcesses | KubernetesDeployments:
    if config.actuator == "local":
        return LocalProcesses(config, config.targets.max_workers)
    if config.actuator == "kubernetes":
        return KubernetesDeployments(config)
    return DryRun()
