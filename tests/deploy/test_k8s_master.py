"""deploy/k8s runs the pool master as a leader and a standby (issue 26, docs/pool.md
"Master failover"): two replicas, each with its own service id, rolled one at a time."""

from tests.deploy.test_k8s import WORKLOADS, _containers, _env


def test_two_masters_with_distinct_ids_and_a_rolling_update():
    master = WORKLOADS["cache-master"]
    assert master["spec"]["replicas"] >= 2
    assert master["spec"]["strategy"]["type"] == "RollingUpdate"
    (container,) = _containers(master)
    sid = _env(container)["TANDEM_CACHE_MASTER_SERVICE_ID"]
    # The claim in the election names the master: replicas must not share an id.
    assert sid["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "TANDEM_CACHE_MASTER_ELECTION" not in _env(container)  # the default: elected
