"""cache_salt at the router: the routing plan matches the KV index with the request's
salted keys (a salt-B request is never routed for salt A's cached prefix), and the field
is validated on both endpoints: a string of 1..256 chars, else a 400 naming it."""

from __future__ import annotations

import random

import pytest

from libs.common.engine.core.kv_hash import PageHasher
from libs.common.engine.core.sampling_params import MAX_CACHE_SALT_CHARS, SamplingParams
from libs.common.messages.control import KvEvent, LoadReport, SamplingSpec
from services.router.dispatch.migration import Generation
from services.router.errors import ApiError
from services.router.formats.openai.validation import parse_request
from services.router.metrics import RouterMetrics
from services.router.routing.kv_index import KvIndex
from services.router.routing.policy import PolicyConfig
from services.router.routing.selector import RouteSelector
from services.router.routing.workers import WorkerTable

PS = 16
TOKENS = list(range(1000, 1000 + 20 * PS))  # 20 full pages


def report(wid: str, role: str) -> LoadReport:
    return LoadReport(worker=wid, role=role, model_id="m", page_size=PS, kv_dtype="float32",
                      waiting=0, running=0, waiting_prefill_tokens=0, free_pages=1000,
                      total_pages=1000, tokens_per_s=0.0, max_model_len=8192,
                      timestamp=0.0)  # fmt: skip


def selector_with_p2_holding(salt: str) -> RouteSelector:
    """Prefill workers p1 and p2, decode worker d; p2's device tier holds TOKENS's pages
    as a request salted `salt` stored them (its KV event)."""
    table = WorkerTable(timeout=60.0)
    for wid, role in (("p1", "prefill"), ("p2", "prefill"), ("d", "decode")):
        table.update(report(wid, role))
    index = KvIndex(10_000)
    keys = PageHasher("m", "float32", PS).keys(TOKENS, cache_salt=salt)
    index.apply(KvEvent(source="p2", seq=1, kind="stored", tier="device", keys=keys))
    return RouteSelector(table, index, PolicyConfig(), "m", RouterMetrics("m"),
                         rng=random.Random(0))  # fmt: skip


@pytest.mark.parametrize("salt", ["tenant-a", ""])
def test_the_plan_routes_to_the_holder_only_with_the_same_salt(salt: str):
    selector = selector_with_p2_holding(salt)
    same = selector.plan(TOKENS, salt)(frozenset())
    assert same is not None and same.prefill == "p2" and same.cached_pages == 20
    for other in {"tenant-a", "tenant-b", ""} - {salt}:
        route = selector.plan(TOKENS, other)(frozenset())
        assert route is not None and route.cached_pages == 0, other


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(("endpoint", "body"), [("completions", COMP), ("chat", CHAT)])
@pytest.mark.parametrize("value", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["a"], {"a": 1}])
def test_a_bad_cache_salt_is_400_naming_it(endpoint, body, value):
    with pytest.raises(ApiError) as e:
        parse_request(endpoint, {**body, "cache_salt": value}, max_n=4)
    assert e.value.status == 400 and e.value.param == "cache_salt", e.value.message
    assert "cache_salt" in e.value.message


@pytest.mark.parametrize(("endpoint", "body"), [("completions", COMP), ("chat", CHAT)])
@pytest.mark.parametrize("value", ["a", "tenant-\u00e9", "x" * MAX_CACHE_SALT_CHARS])
def test_a_good_cache_salt_reaches_the_sampling(endpoint, body, value):
    req = parse_request(endpoint, {**body, "cache_salt": value}, max_n=4)
    assert req.sampling["cache_salt"] == value
    assert "cache_salt" not in parse_request(endpoint, body, max_n=4).sampling


def test_a_migrated_generation_keeps_its_salt():
    spec = SamplingSpec(**SamplingParams(temperature=1.0, cache_salt="tenant-a").to_dict())
    gen = Generation([1, 2, 3], spec, lambda chunk: None)
    assert gen.sampling.seed is not None  # replaced for its continuations...
    assert gen.sampling.cache_salt == "tenant-a"  # ...and still salted
