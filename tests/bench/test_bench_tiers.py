"""bench.tiers' configurations: the same build, differing only where the experiment says."""

from __future__ import annotations

import asyncio
import sys

import pytest

from bench import tiers
from bench.deployments import PeerServer


def topos(*argv: str):
    return tiers.topologies(tiers.parser().parse_args(list(argv)))


def test_cache_tiers_differ_only_in_cache_flags_and_the_pool():
    t = topos("--threads", "1", "--prefill-kv-mb", "24")
    base, l1, pool = t["baseline"], t["L1"], t["L1+pool"]
    assert all((x.prefill, x.decode) == (2, 1) for x in (base, l1, pool))
    assert "--no-prefix-cache" in base.worker_args and "--no-pool" in base.worker_args
    assert "--no-prefix-cache" not in l1.worker_args and "--no-pool" in l1.worker_args
    assert "--no-pool" not in pool.worker_args and pool.pool and not l1.pool
    assert base.role_args == l1.role_args == pool.role_args
    assert base.role_args["prefill"] == ["--kv-cache-mb", "24"]
    assert base.router_args == l1.router_args == pool.router_args == []


def test_aggregated_prefills_on_decode_and_disaggregated_never_does():
    t = topos()
    agg, dis = t["aggregated"], t["disaggregated"]
    assert (agg.both, agg.prefill, agg.decode) == (2, 0, 0) and dis.prefill == dis.decode == 1
    assert int(agg.router_args[agg.router_args.index("--disagg-threshold") + 1]) >= 10**6
    assert dis.router_args == ["--disagg-threshold", "0"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--configs", "L1,L9"], "--configs"),
        (["--threads", "0"], "--threads"),
        (["--num-rounds", "0"], "--num-rounds"),
        (["--slo", "x:1"], "--slo"),
    ],
)
def test_bad_flags_fail_before_anything_starts(argv, flag, capsys, tmp_path):
    assert tiers.main([*argv, "--workdir", str(tmp_path)]) == 2
    assert flag in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was started


def test_peer_is_reported_as_not_run_where_it_cannot_start(tmp_path):
    a = tiers.parser().parse_args(["--peer-python", str(tmp_path / "nope"), "--workdir",
                                   str(tmp_path)])  # fmt: skip
    run = asyncio.run(tiers.run_one("peer", a, tiers.topologies(a)))
    assert run["note"].startswith("not run: no interpreter")
    assert "summary" not in run


def test_unknown_peer_kind_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--peer"):
        PeerServer("vllm", sys.executable, tmp_path, tmp_path, 1)
