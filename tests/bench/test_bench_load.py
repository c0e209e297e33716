"""bench.load against its own real cluster, tiny: the JSON report holds the invariants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import load

pytestmark = pytest.mark.slow


def test_tiny_load_completes_with_exact_usage_and_throttles_with_retry_after(tmp_path: Path):
    out = tmp_path / "load.json"
    # 4 clients against a router bound of 2 requests in flight: some get 429s.
    code = load.main(["--clients", "4", "--duration", "10", "--max-tokens", "4",
                      "--max-prompt", "160", "--router-arg=--max-pending", "--router-arg=2",
                      "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0, report
    assert report["requests_completed"] >= 2 and report["requests_cut_off"] == 0
    assert report["completed_usage_correct"] == report["requests_completed"]
    assert report["http_429"] >= 1 and report["throttled_without_retry_after"] == 0
    assert report["server_errors_5xx"] == 0 and report["other_errors"] == 0, report["samples"]
    assert report["ttft_p50_s"] is not None and report["ttft_p99_s"] >= report["ttft_p50_s"]
    services = set(report["memory"])
    assert {"router", "prefill-1", "decode-1", "nats-server"} <= services
    assert all(m["peak_rss_mb"] >= m["end_rss_mb"] > 0 for m in report["memory"].values())
    assert set(report["exit_codes"].values()) == {0}
