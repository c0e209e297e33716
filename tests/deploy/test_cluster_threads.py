"""`make run` splits the host's cores between its two model workers, and starts N routers."""

from __future__ import annotations

import os

from scripts.cluster import TOPOLOGY, identities, router_ports, topology, worker_threads


def test_each_model_worker_gets_half_the_cores_at_least_one():
    half = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert worker_threads({}) == {
        "TANDEM_PREFILL_NUM_THREADS": half,
        "TANDEM_DECODE_NUM_THREADS": half,
    }


def test_a_thread_count_in_the_environment_wins():
    got = worker_threads({"TANDEM_PREFILL_NUM_THREADS": "3"})
    assert "TANDEM_PREFILL_NUM_THREADS" not in got and "TANDEM_DECODE_NUM_THREADS" in got


def test_n_routers_get_their_own_service_ids_identities_and_consecutive_ports():
    specs = topology(3)
    routers = [(label, extra[1]) for label, service, extra in specs if service == "router"]
    assert routers == [("router", "router-1"), ("router_2", "router-2"), ("router_3", "router-3")]
    names = [i.name for i in identities(specs)]
    assert len(names) == len(set(names)) and {"router", "router_2", "router_3"} <= set(names)
    assert router_ports(3, 8000) == {
        "router": ["--port", "8000"],
        "router_2": ["--port", "8001"],
        "router_3": ["--port", "8002"],
    }
    assert topology(1) == TOPOLOGY
