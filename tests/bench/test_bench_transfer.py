"""bench.transfer end to end on loopback: every case of tcp and shm is measured against a
peer process and reported, with the shm/memcpy ratios; bad arguments are refused."""

from __future__ import annotations

import orjson
import pytest

from bench import transfer

CASES = {"1 x 4 KiB", "1 x 64 KiB", "1 x 1 MiB", "1 x 16 MiB", "64 x 1 MiB"}


def test_every_case_of_both_transports_is_measured_and_reported(capsys) -> None:
    argv = ["--json", "--seconds", "0.01", "--max-iters", "5", "--no-mooncake", "--no-floors"]
    assert transfer.main(argv) == 0
    report = orjson.loads(capsys.readouterr().out)
    rows = {(r["transport"], r["op"], r["case"]): r for r in report["rows"]}
    expected = {("memcpy", "copy", c) for c in CASES}
    expected |= {(t, op, c) for t in ("tcp", "shm") for op in ("write", "read") for c in CASES}
    assert set(rows) == expected
    for row in rows.values():
        assert row["iters"] >= 5 and row["gbps"] > 0 and 0 < row["p50_us"] <= row["p99_us"]
    assert report["meta"]["mooncake"] == "skipped (--no-mooncake)"
    assert any(line.startswith("shm/memcpy write 1 x 1 MiB") for line in report["meta"]["ratios"])


@pytest.mark.parametrize("argv", [["--transports", "rdma"], ["--transports", "tcp,tpc"],
                                  ["--ops", "copy"], ["--transports", ""]])  # fmt: skip
def test_unknown_transports_or_ops_are_refused_at_once(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        transfer.main(argv)
    assert info.value.code == 2
    assert "a comma list of" in capsys.readouterr().err


def test_handoff_rows_time_the_same_pages_with_and_without_their_mac(capsys) -> None:
    argv = ["--json", "--seconds", "0.01", "--max-iters", "5", "--no-mooncake", "--no-floors",
            "--transports", "tcp", "--ops", "write", "--handoff"]  # fmt: skip
    assert transfer.main(argv) == 0
    rows = orjson.loads(capsys.readouterr().out)["rows"]
    handoff = {(r["op"], r["case"]): r for r in rows if r["transport"] == "tcp"}
    for n in (8, 32, 80):
        plain, checked = handoff[("handoff", f"{n} pages")], handoff[("handoff+mac", f"{n} pages")]
        assert plain["bytes"] == checked["bytes"] == n * 737_280  # SmolLM2-135M fp32 pages
        assert handoff[("mac only", f"{n} pages")]["p50_us"] > 0
