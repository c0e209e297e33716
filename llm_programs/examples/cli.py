"""The command line the examples share: run `program` on `inputs(n)` as one batch and
print each result as a JSON line (what `show` picks from the state), or stream the first
input's gens as they come."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from llm_programs import Program, Router, State


def main(
    program: Program,
    inputs: Callable[[int], list[dict[str, Any]]],
    show: Callable[[State], dict[str, Any]],
    argv: list[str] | None = None,
) -> int:
    p = argparse.ArgumentParser(
        prog=f"python -m llm_programs.examples.{program.name}", description=program.__doc__
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the router")
    p.add_argument("--model", default="default")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per call at most")
    p.add_argument("-n", type=int, default=2, help="inputs to run")
    p.add_argument("--concurrency", type=int, default=4, help="programs at once at most")
    p.add_argument("--stream", action="store_true", help="stream the first input's text")
    a = p.parse_args(argv)
    router = Router(a.base_url, model=a.model, timeout=a.timeout)
    if a.stream:
        return asyncio.run(_stream(program, router, inputs(1)[0], show))
    states = program.run_batch(router, inputs(a.n), concurrency=a.concurrency)
    for state in states:
        print(json.dumps(show(state), ensure_ascii=False))
    return 0


async def _stream(program: Program, router: Router, kwargs: dict[str, Any], show) -> int:
    run = program.stream(router, **kwargs)
    name = None
    async for piece in run:
        if piece.call != name:
            name = piece.call
            print(f"\n[{name}]", flush=True)
        print(piece.text, end="", flush=True)
    print("\n" + json.dumps(show(run.state), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit("run one of the examples: python -m llm_programs.examples.<name>")
