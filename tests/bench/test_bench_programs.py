"""bench.programs: its two configurations differ only in the prefix cache flag, and what it
reports is computed from the states' call records."""

from __future__ import annotations

import pytest

from bench import programs
from llm_programs import CallRecord, Router, State, Usage


def test_the_configurations_differ_only_in_the_prefix_cache():
    t = programs.topologies(programs.parser().parse_args([]))
    on, off = t["prefix-cache"], t["no-prefix-cache"]
    assert (on.prefill, on.decode) == (off.prefill, off.decode) == (1, 1)
    assert off.worker_args == [*on.worker_args, "--no-prefix-cache", "true"]
    assert "--no-pool" in on.worker_args and not on.pool and not off.pool
    assert on.router_args == off.router_args == []


def test_tally_counts_requests_by_kind_and_tokens_without_renders():
    s = State(Router("http://127.0.0.1:9"))
    s.calls += [
        CallRecord("a", "gen", {}, Usage(100, 64, 5)),
        CallRecord("b", "score", {}, Usage(50, 48, 0)),
        CallRecord("c", "render", {}),
    ]
    out = programs.tally([s, s])
    assert out["requests"] == {"gen": 2, "score": 2, "render": 2}
    assert (out["prompt_tokens"], out["cached_tokens"], out["cached_share"]) == (300, 224, 0.747)


@pytest.mark.parametrize(
    "argv, flag", [(["--examples", "chat"], "--examples"), (["--texts", "0"], "--texts")]
)
def test_bad_flags_fail_before_anything_starts(argv, flag, capsys, tmp_path):
    assert programs.main([*argv, "--workdir", str(tmp_path)]) == 2
    assert flag in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
