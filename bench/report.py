"""How results are shown: the summary table, per-round and comparison tables, JSON, plots.

Tables are markdown, so the same text goes to a terminal and into docs/benchmarks.md.
matplotlib is imported only by `plot` (a run without --plot does not need it) and draws
with the Agg backend into a small PNG (about 900x300 px).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import orjson

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def _table(header: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def summary_table(s: dict[str, Any]) -> str:
    """Counts and throughputs, then one row per latency metric."""
    rows = [
        ["requests (ok / failed)", f"{s['completed']} / {s['failed']}"],
        ["duration", f"{s['duration_s']:.2f} s"],
        ["prompt tokens (cached)", f"{s['prompt_tokens']} ({s['cached_tokens']})"],
        ["completion tokens", f"{s['completion_tokens']}"],
        ["cache hit rate", f"{s['cache_hit_rate']:.1%}"],
        ["request throughput", f"{s['request_throughput']:.3f} req/s"],
        ["input throughput", f"{s['input_throughput']:.1f} tok/s"],
        ["output throughput", f"{s['output_throughput']:.1f} tok/s"],
    ]
    if "goodput" in s:
        rows.append([f"goodput ({s['slo']})", f"{s['goodput']:.3f} req/s ({s['good_requests']})"])
    head = _table(["metric", "value"], rows)
    lat = _table(
        ["latency (ms)", "mean", "median", "p90", "p99", "max"],
        [[name] + [f"{s[key][q]:.1f}" for q in ("mean", "median", "p90", "p99", "max")]
         for name, key in LATENCIES],
    )  # fmt: skip
    text = f"{head}\n\n{lat}"
    if s.get("errors"):
        text += "\n\nerrors: " + "; ".join(s["errors"])
    return text


def rounds_table(rounds: list[dict[str, Any]]) -> str:
    return _table(
        ["round", "requests", "hit rate", "mean TTFT ms", "p90 TTFT ms", "input tok/s"],
        [[str(r["round"] + 1), str(r["completed"]), f"{r['cache_hit_rate']:.1%}",
          f"{r['ttft_ms']['mean']:.0f}", f"{r['ttft_ms']['p90']:.0f}",
          f"{r['input_throughput']:.1f}"] for r in rounds],
    )  # fmt: skip


def compare_table(runs: dict[str, dict[str, Any]]) -> str:
    """One row per configuration: the numbers the tiers experiment reports."""
    rows = []
    for name, run in runs.items():
        s = run.get("summary")
        if s is None:
            rows.append([name] + ["-"] * 7 + [run.get("note", "not run")])
            continue
        rows.append([
            name, f"{s['completed']}/{s['requests']}", f"{s['cache_hit_rate']:.1%}",
            f"{s['ttft_ms']['mean']:.0f}", f"{s['ttft_ms']['p90']:.0f}",
            f"{s['tpot_ms']['mean']:.1f}", f"{s['input_throughput']:.1f}",
            f"{s['output_throughput']:.1f}", run.get("note", ""),
        ])  # fmt: skip
    return _table(
        ["configuration", "ok", "hit rate", "mean TTFT ms", "p90 TTFT ms", "mean TPOT ms",
         "input tok/s", "output tok/s", "note"],
        rows,
    )  # fmt: skip


def emit(report: dict[str, Any], as_json: bool) -> None:
    """A bench's report on stdout: one indented JSON object, or a `key: value` line each."""
    if as_json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for key, value in report.items():
            print(f"{key}: {value}")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def plot(runs: dict[str, dict[str, Any]], path: Path, title: str = "") -> None:
    """TTFT (mean, p90) and input throughput by configuration; mean TTFT per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {k: v for k, v in runs.items() if v.get("summary")}
    if not done:
        raise ValueError("--plot: no completed run to plot")
    with_rounds = {k: v for k, v in done.items() if len(v.get("rounds") or []) > 1}
    ncols = 3 if with_rounds else 2
    fig, axes = plt.subplots(1, ncols, figsize=(3.2 * ncols, 3.0), dpi=90)
    names = list(done)
    xs = range(len(names))
    mean = [done[n]["summary"]["ttft_ms"]["mean"] / 1000 for n in names]
    p90 = [done[n]["summary"]["ttft_ms"]["p90"] / 1000 for n in names]
    axes[0].bar([x - 0.2 for x in xs], mean, 0.4, label="mean")
    axes[0].bar([x + 0.2 for x in xs], p90, 0.4, label="p90")
    axes[0].set_title("TTFT (s)", fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].bar(xs, [done[n]["summary"]["input_throughput"] for n in names], 0.6)
    axes[1].set_title("input throughput (tok/s)", fontsize=9)
    for ax in axes[:2]:
        ax.set_xticks(list(xs), names, rotation=25, ha="right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    if with_rounds:
        ax = axes[2]
        for name, run in with_rounds.items():
            rounds = run["rounds"]
            ax.plot([r["round"] + 1 for r in rounds],
                    [r["ttft_ms"]["mean"] / 1000 for r in rounds], marker="o", ms=3,
                    label=name)  # fmt: skip
        ax.set_title("mean TTFT per round (s)", fontsize=9)
        ax.set_xlabel("round", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
