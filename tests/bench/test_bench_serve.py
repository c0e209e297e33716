"""bench.serve against a fake server with known delays: its numbers must come out right."""

from __future__ import annotations

import json
import math

import pytest

from bench import serve
from bench.client import Endpoint
from bench.driver import Arrivals
from bench.metrics import Slo
from bench.workloads import MultiTurn
from tests.bench.fake_server import FakeServer

TTFT, ITL, TOKENS = 0.15, 0.03, 6


def random_workload(n: int, output_len: int = TOKENS) -> MultiTurn:
    return MultiTurn(n, 1, 20, 20, output_len)


async def run(server: FakeServer, workload, rate=math.inf, cap=0, duration=30.0, slo=None):
    endpoint = Endpoint(server.url, "fake-model", timeout=10)
    return await serve.benchmark(endpoint, workload, Arrivals(rate, cap, duration), slo,
                                 progress=False)  # fmt: skip


async def test_ttft_itl_tpot_e2e_match_the_server_delays():
    async with FakeServer(ttft=TTFT, itl=ITL) as server:
        out = await run(server, random_workload(4), cap=4)
        seen = {x.body["messages"][0]["content"].split(".")[0]: x for x in server.seen}
    s = out["summary"]
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["ttft_ms"]["mean"] >= TTFT * 1000 and s["itl_ms"]["median"] >= ITL * 1000 * 0.9
    for r in out["requests"]:
        srv = seen[f"Conversation {r['client']}"]
        gaps = [b - a for a, b in zip(srv.token_times, srv.token_times[1:], strict=False)]
        # The tool's clock starts before the request is sent and stops after the last byte
        # is read: its spans are the server's plus socket overhead, never less.
        assert 0 <= r["ttft_s"] - (srv.token_times[0] - srv.start) < 0.1
        assert 0 <= r["e2e_s"] - (srv.end - srv.start) < 0.1
        assert len(r["itl_s"]) == TOKENS - 1 and r["completion_tokens"] == TOKENS
        assert abs(sum(r["itl_s"]) - sum(gaps)) < 0.05
        tpot = (r["e2e_s"] - r["ttft_s"]) / (TOKENS - 1)
        assert r["tpot_s"] == pytest.approx(tpot, abs=1e-5)
        assert abs(tpot - sum(gaps) / len(gaps)) < 0.02


async def test_throughput_is_tokens_over_the_run_duration():
    async with FakeServer(ttft=0.05, itl=0.01) as server:
        out = await run(server, random_workload(3, output_len=5), cap=1)  # one at a time
        prompt = sum(x.prompt_tokens for x in server.seen)
        busy = server.seen[-1].end - server.seen[0].start
    s = out["summary"]
    assert s["duration_s"] >= 3 * (0.05 + 4 * 0.01)
    assert 0 <= s["duration_s"] - busy < 0.1
    assert s["completion_tokens"] == 15 and s["prompt_tokens"] == prompt
    assert s["output_throughput"] == pytest.approx(15 / s["duration_s"])
    assert s["input_throughput"] == pytest.approx(prompt / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(3 / s["duration_s"])


async def test_multi_turn_resends_history_and_hit_rate_matches_server():
    workload = MultiTurn(3, 3, 10, 5, 4, barrier=True)
    async with FakeServer(ttft=0.02, itl=0.005) as server:
        out = await run(server, workload)
        seen = list(server.seen)
    assert out["summary"]["completed"] == 9
    by_client: dict[str, list] = {}
    for x in seen:
        by_client.setdefault(x.body["messages"][0]["content"], []).append(x.body["messages"])
    for convo in by_client.values():
        assert [len(m) for m in convo] == [1, 3, 5]  # user, +assistant +user per round
        assert convo[1][1] == {"role": "assistant", "content": " w0 w1 w2 w3"}
        assert convo[2][:3] == convo[1]
    cached, prompt = sum(x.cached_tokens for x in seen), sum(x.prompt_tokens for x in seen)
    assert out["summary"]["cache_hit_rate"] == pytest.approx(cached / prompt)
    rounds = out["rounds"]
    assert [r["completed"] for r in rounds] == [3, 3, 3]
    assert rounds[0]["cache_hit_rate"] == 0.0 and rounds[2]["cache_hit_rate"] > 0.5


async def test_round_barrier_starts_no_round_before_the_last_one_ends():
    workload = MultiTurn(3, 3, 10, 5, 3, range_ratio=0.5, barrier=True)
    async with FakeServer(ttft=0.01, itl=0.01) as server:
        out = await run(server, workload)
    reqs = out["requests"]
    for rnd in (1, 2):
        prev_end = max(r["start_s"] + r["e2e_s"] for r in reqs if r["round"] == rnd - 1)
        first_start = min(r["start_s"] for r in reqs if r["round"] == rnd)
        assert first_start >= prev_end - 1e-3


async def test_poisson_rate_paces_the_sends():
    async with FakeServer(ttft=0.0, itl=0.0) as server:
        out = await run(server, random_workload(40, output_len=1), rate=40.0)
    starts = sorted(r["start_s"] for r in out["requests"])
    # 39 exponential gaps of mean 25 ms: their sum is ~0.98 s, and within 0.5-1.6 s
    # with probability > 0.999 (Gamma(39) is within ~±32% at 3 sigma).
    assert 0.5 < starts[-1] - starts[0] < 1.6


async def test_max_concurrency_caps_requests_in_flight():
    async with FakeServer(ttft=0.05, itl=0.0) as server:
        await run(server, random_workload(9, output_len=1), cap=3)
        events = sorted([(x.start, 1) for x in server.seen] + [(x.end, -1) for x in server.seen])
    depth = peak = 0
    for _, step in events:
        depth += step
        peak = max(peak, depth)
    assert peak == 3


async def test_goodput_counts_requests_within_the_slo():
    async with FakeServer(ttft=0.1, itl=0.01) as server:
        tight = await run(server, random_workload(3), slo=Slo.parse("ttft:50"))
        loose = await run(server, random_workload(3), slo=Slo.parse("ttft:2000,tpot:500"))
    assert tight["summary"]["good_requests"] == 0 and tight["summary"]["goodput"] == 0
    assert loose["summary"]["good_requests"] == 3
    assert loose["summary"]["goodput"] == pytest.approx(loose["summary"]["request_throughput"])


async def test_http_errors_are_counted_as_failures():
    async with FakeServer(ttft=0.01, itl=0.0, fail_every=2) as server:
        out = await run(server, random_workload(6, output_len=2), cap=1)
    s = out["summary"]
    assert (s["completed"], s["failed"]) == (3, 3)
    assert any("HTTP 500" in e for e in s["errors"])


async def test_time_limit_cancels_requests_in_flight():
    async with FakeServer(ttft=5.0, itl=0.0) as server:
        out = await run(server, random_workload(2), duration=0.3)
    s = out["summary"]
    assert s["failed"] == 2 and s["errors"] == ["cancelled at the time limit"]
    assert s["duration_s"] < 1.0


async def test_completions_api_sends_one_prompt():
    async with FakeServer(ttft=0.01, itl=0.0) as server:
        endpoint = Endpoint(server.url, "fake-model", api="completions", timeout=10)
        out = await serve.benchmark(endpoint, random_workload(2, 3), Arrivals(), progress=False)
        assert all("prompt" in x.body and x.body["ignore_eos"] for x in server.seen)
    assert out["summary"]["completion_tokens"] == 6


async def test_cli_writes_json_with_per_request_timings_and_a_small_plot(tmp_path):
    async with FakeServer(ttft=0.02, itl=0.005) as server:
        args = serve.parser().parse_args([
            "--base-url", server.url, "--workload", "multi-turn", "--num-clients", "2",
            "--num-rounds", "2", "--input-len", "8", "--output-len", "3", "--round-barrier",
            "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
            "--no-progress", "--slo", "ttft:1000",
        ])  # fmt: skip
        assert await serve._main(args) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["model"] == "fake-model"
    assert len(data["requests"]) == 4 and len(data["rounds"]) == 2
    assert {"ttft_s", "itl_s", "e2e_s", "cached_tokens"} <= set(data["requests"][0])
    png = (tmp_path / "r.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) < 100_000


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--slo", "latency:5"], "--slo"),
        (["--request-rate", "0"], "--request-rate"),
        (["--duration", "inf"], "--duration"),
        (["--num-clients", "0"], "--num-clients"),
        (["--workload", "random", "--output-len", "0"], "--output-len"),
        (["--api", "chat", "--request-timeout", "0"], "--request-timeout"),
    ],
)
def test_bad_flags_raise_value_error_naming_the_flag(argv, flag):
    a = serve.parser().parse_args([*argv, "--model", "m"])
    with pytest.raises(ValueError, match=flag):
        Slo.parse(a.slo)
        serve.make_workload(a)
        serve.make_arrivals(a)
        Endpoint(a.base_url, a.model, a.api, timeout=a.request_timeout)


async def test_several_base_urls_share_the_requests_round_robin():
    async with FakeServer(ttft=0.01, itl=0.01) as one, FakeServer(ttft=0.01, itl=0.01) as two:
        endpoint = Endpoint(f"{one.url}, {two.url}/", "fake-model", timeout=10)
        out = await serve.benchmark(endpoint, random_workload(6), Arrivals(math.inf, 2, 30.0),
                                    None, progress=False)  # fmt: skip
        assert out["summary"]["completed"] == 6
        assert (len(one.seen), len(two.seen)) == (3, 3)
