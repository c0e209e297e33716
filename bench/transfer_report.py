"""bench.transfer's output: the markdown table and the goals of issue 4 as ratios."""

from __future__ import annotations

from typing import Any

KIB, MIB = 1 << 10, 1 << 20
BATCH = (64, MIB)


def _human(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| transport | op | case | GB/s | p50 µs | p99 µs | iters |\n"
        + "|---" * 3
        + "|---:" * 4
        + "|"
    )
    body = [f"| {r['transport']} | {r['op']} | {r['case']} | {r['gbps']} | {r['p50_us']} | "
            f"{r['p99_us']} | {r['iters']} |" for r in rows]  # fmt: skip
    return "\n".join([head, *body])


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's goals, as ratios within this run."""
    by = {(r["transport"], r["op"], r["case"]): r for r in rows}
    lines = []
    batch = f"{BATCH[0]} x {_human(BATCH[1])}"
    for op in ("write", "read"):
        ours, theirs = by.get(("tcp", op, batch)), by.get(("mooncake-tcp", op, batch))
        if ours and theirs:
            lines.append(f"tcp/mooncake {op} {batch}: {ours['gbps'] / theirs['gbps']:.2f}x GB/s")
        ours, theirs = by.get(("tcp", op, "1 x 4 KiB")), by.get(("mooncake-tcp", op, "1 x 4 KiB"))
        if ours and theirs:
            lines.append(f"tcp/mooncake {op} 4 KiB p50: {ours['p50_us'] / theirs['p50_us']:.2f}x")
        for case in ("1 x 1 MiB", "1 x 16 MiB", batch):
            ours, base = by.get(("shm", op, case)), by.get(("memcpy", "copy", case))
            if ours and base:
                lines.append(f"shm/memcpy {op} {case}: {100 * ours['gbps'] / base['gbps']:.0f}%")
    lines += _floor_lines(by, batch)
    return lines


def _floor_lines(by: dict[tuple[str, str, str], dict[str, Any]], batch: str) -> list[str]:
    """Where tcp and Mooncake stand against the bare-socket floors of this run."""
    lines = []
    goal = by.get(("mooncake-tcp", "write", "1 x 4 KiB"))
    for floor in ("floor-pingpong", "floor-pingpong-poll"):
        row = by.get((floor, "write", "1 x 4 KiB"))
        if row:
            line = f"{floor} 4 KiB p50: {row['p50_us']} µs"
            if goal:
                line += f" (goal: tcp write p50 <= {goal['p50_us'] / 2:.1f} µs)"
            lines.append(line)
    streams = sorted(k[0] for k in by if k[0].startswith("floor-stream") and k[2] == batch)
    for floor in streams:
        ceiling = by[(floor, "write", batch)]["gbps"]
        for op in ("write", "read"):
            ours = by.get(("tcp", op, batch))
            if ours:
                lines.append(f"tcp/{floor} {op} {batch}: {ours['gbps']} / {ceiling} GB/s "
                             f"= {100 * ours['gbps'] / ceiling:.0f}%")  # fmt: skip
    return lines
