"""Routing policy and the worker table: KV-aware prefill cost, decode by load, liveness."""

import random

from libs.common.messages.control import LoadReport
from services.router.routing.kv_index import PrefixMatch
from services.router.routing.policy import PolicyConfig, choose, prefill_cost
from services.router.routing.workers import Worker, WorkerTable

PS = 16


def report(wid, role, **kw):
    base = dict(worker=wid, role=role, model_id="m", page_size=PS, kv_dtype="float32",
                waiting=0, running=0, waiting_prefill_tokens=0, free_pages=1000,
                total_pages=1000, tokens_per_s=0.0, max_model_len=8192, timestamp=0.0)  # fmt: skip
    return LoadReport(**{**base, **kw})


def worker(wid, role, **kw):
    return Worker(report(wid, role, **kw), seen_at=0.0)


def match(covered=None, local=None, pool=0):
    covered = covered or {}
    return PrefixMatch(pool=pool, local=local or dict(covered), covered=covered)


CFG = PolicyConfig(disagg_threshold=32)


def test_prefill_goes_to_the_worker_holding_the_longest_prefix():
    p1, p2, d = worker("p1", "prefill"), worker("p2", "prefill"), worker("d", "decode")
    m = match(covered={"p2": 20})
    for seed in range(20):
        r = choose(400, PS, m, [d], [p1, p2], CFG, rng=random.Random(seed))
        assert (r.decode, r.prefill, r.reason) == ("d", "p2", "disaggregated")
        assert r.cached_pages == 20


def test_load_outweighs_a_small_cache_hit():
    p1 = worker("p1", "prefill")
    p2 = worker("p2", "prefill", waiting_prefill_tokens=4000, running=8)
    m = match(covered={"p2": 2})
    r = choose(400, PS, m, [worker("d", "decode")], [p1, p2], CFG, rng=random.Random(0))
    assert r.prefill == "p1"


def test_pool_hits_count_for_every_worker_but_cost_a_little_more_than_local_ones():
    w1, w2 = worker("p1", "prefill"), worker("p2", "prefill")
    m = PrefixMatch(pool=10, local={"p1": 10, "p2": 0}, covered={"p1": 10, "p2": 10})
    assert prefill_cost(w1, 320, PS, m, CFG) < prefill_cost(w2, 320, PS, m, CFG)
    assert prefill_cost(w2, 320, PS, m, CFG) < prefill_cost(w2, 320, PS, match(), CFG)


def test_short_uncached_part_is_prefilled_by_the_decode_worker():
    p, d = worker("p", "prefill"), worker("d", "decode")
    assert choose(30, PS, match(), [d], [p], CFG, rng=random.Random(0)).reason == "below_threshold"
    cached = match(covered={"d": 24})  # 384 of 400 tokens cached on d
    r = choose(400, PS, cached, [d], [p], CFG, rng=random.Random(0))
    assert (r.prefill, r.reason) == ("", "below_threshold")


def test_decode_worker_that_holds_the_prefix_wins_when_it_can_prefill_itself():
    d1, d2, p = worker("d1", "decode"), worker("d2", "decode"), worker("p", "prefill")
    m = match(covered={"d2": 24})
    for seed in range(10):
        assert choose(400, PS, m, [d1, d2], [p], CFG, rng=random.Random(seed)).decode == "d2"


def test_decode_choice_prefers_free_pages_and_few_running():
    busy = worker("d1", "decode", running=5)
    full = worker("d2", "decode", free_pages=10)
    idle = worker("d3", "decode")
    r = choose(40, PS, match(), [busy, full, idle], [], CFG, rng=random.Random(0))
    assert r.decode == "d3" and r.reason == "no_prefill_worker"


def test_ties_are_broken_at_random_so_unrelated_prompts_spread():
    ws = [worker(f"p{i}", "prefill") for i in range(3)]
    rng = random.Random(1)
    seen = {choose(400, PS, match(), [worker("d", "decode")], ws, CFG, rng=rng).prefill
            for _ in range(60)}  # fmt: skip
    assert seen == {"p0", "p1", "p2"}


def test_both_worker_prefills_itself_when_cheapest():
    b = worker("b", "both")
    r = choose(400, PS, match(), [b], [], CFG, rng=random.Random(0))
    assert (r.decode, r.prefill) == ("b", "")


def test_both_workers_prefill_for_a_decode_worker_and_never_hand_off_to_themselves():
    b1, b2 = worker("b1", "both", running=5), worker("b2", "both")
    d = worker("d", "decode")
    # The decode worker takes the long prompt; the idle `both` worker prefills it.
    r = choose(400, PS, match(), [d], [b1, b2], CFG, rng=random.Random(0))
    assert (r.decode, r.prefill, r.reason) == ("d", "b2", "disaggregated")
    # A `both` worker chosen to decode prefills itself rather than over the network.
    for seed in range(8):
        r = choose(400, PS, match(), [b2], [b2], CFG, rng=random.Random(seed))
        assert (r.decode, r.prefill) == ("b2", "")


def test_no_decode_worker_means_no_route():
    assert choose(40, PS, match(), [], [worker("p", "prefill")], CFG, rng=random.Random(0)) is None


def test_silent_worker_leaves_rotation_after_the_timeout():
    now = [100.0]
    table = WorkerTable(timeout=3.0, clock=lambda: now[0])
    assert table.update(report("d1", "decode")) is True
    assert table.update(report("p1", "prefill")) is True
    assert table.ready()
    now[0] += 2.9
    table.update(report("p1", "prefill"))
    assert [w.id for w in table.live("decode")] == ["d1"]
    now[0] += 0.2
    assert table.live("decode") == [] and not table.ready()
    assert [w.id for w in table.prune()] == ["d1"] and len(table) == 1


def test_ready_needs_prefill_and_decode_or_both():
    table = WorkerTable(timeout=3.0)
    table.update(report("p1", "prefill"))
    assert not table.ready()
    table.update(report("b1", "both"))
    assert table.ready()


def test_router_inflight_counts_until_the_next_report_catches_up():
    w = worker("p", "prefill", waiting_prefill_tokens=100)
    w.pending_prefill_tokens = 500
    w.inflight |= {"a", "b", "c"}
    assert w.queued_prefill_tokens == 500 and w.running == 3


def test_report_with_an_unknown_role_is_ignored():
    table = WorkerTable(timeout=3.0)
    assert table.update(report("x", "teapot")) is False and len(table) == 0
