"""The kubernetes actuator through the official client, against a fake API server.

No Kubernetes cluster runs here: a small aiohttp server on loopback answers the two
endpoints the actuator uses (GET and PATCH of a Deployment's scale subresource) the way
the API server does, and records each patch (conftest.py's LoopbackApiServer). The
planner is a real process.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from tests.planner.conftest import Feeder, LoopbackApiServer, report, wait_for

SCALE = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"


class FakeApiServer(LoopbackApiServer):
    """Deployments' replica counts, by name, behind their scale subresource."""

    route = SCALE

    def __init__(self, replicas: dict[str, int]):
        super().__init__()
        self.replicas = dict(replicas)

    def _scale(self, namespace: str, name: str) -> web.Response:
        n = self.replicas[name]
        return web.json_response({
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": n}, "status": {"replicas": n},
        })  # fmt: skip

    async def get(self, request: web.Request) -> web.Response:
        info = request.match_info
        if info["name"] not in self.replicas:
            return self.status(404, f'deployments.apps "{info["name"]}" not found')
        return self._scale(info["namespace"], info["name"])

    async def patch(self, request: web.Request) -> web.Response:
        info = request.match_info
        if info["name"] not in self.replicas:
            return self.status(404, f'deployments.apps "{info["name"]}" not found')
        body = orjson.loads(await request.read())
        self.patches.append((request.path, request.content_type, body))
        self.replicas[info["name"]] = int(body["spec"]["replicas"])
        return self._scale(info["namespace"], info["name"])


async def test_decode_queue_patches_the_decode_deployment_replicas(planner_cluster):
    _cluster, nc, start = planner_cluster
    api = FakeApiServer({"prefill": 1, "decode": 1})
    await api.start()
    feeder = Feeder(nc)
    try:
        await start("planner-k", "--actuator", "kubernetes", "--k8s-api", api.url,
                    "--k8s-namespace", "serving", "--max-decode", "3")  # fmt: skip
        # 60 sequences at 14 + 4 ms each: a 100 ms ITL fits 21 a worker, so 3.
        feeder.reports = [report("prefill", "prefill-1"),
                          report("decode", "decode-1", running=60, max_running=64)]  # fmt: skip
        feeder.start()

        async def scaled():
            return [p for p in api.patches if p[0].endswith("/deployments/decode/scale")]

        await wait_for(scaled, 30, "a patch of the decode deployment's scale")
        # The planner started from the Deployments' replicas (read, not patched): the
        # first patch is the decision, and the prefill Deployment was never patched.
        assert len(api.patches) == 1
        path, content_type, body = api.patches[0]
        assert path == "/apis/apps/v1/namespaces/serving/deployments/decode/scale"
        assert body == {"spec": {"replicas": 3}}
        assert content_type.endswith("patch+json")
        assert api.replicas == {"prefill": 1, "decode": 3}
    finally:
        await feeder.stop()
        await api.stop()
