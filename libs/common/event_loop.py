"""The event loop every Tandem process runs on: uvloop where it is installed, else asyncio's.

uvloop (libuv under asyncio's API) cuts the Python cost of each NATS round trip, most of
a pool `exists` or of a router hop (measured: docs/pool.md, "Round trips"). Services
choose with `--event-loop` (or `TANDEM_EVENT_LOOP`), benchmarks and scripts with
`TANDEM_EVENT_LOOP`; `asyncio` is there to debug or to compare.

    run(main())             instead of asyncio.run(main())
    loop_name("uvloop")     what run() would use: "asyncio" when uvloop is not installed
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name(requested: str | None = None) -> str:
    """ "uvloop" or "asyncio": `requested`, else $TANDEM_EVENT_LOOP, else uvloop if present."""
    requested = requested or os.environ.get("TANDEM_EVENT_LOOP") or "uvloop"
    if requested == "uvloop" and importlib.util.find_spec("uvloop") is not None:
        return "uvloop"
    return "asyncio"


def run(main: Coroutine[Any, Any, T], requested: str | None = None) -> T:
    """asyncio.run(main) on the loop `loop_name(requested)` names."""
    if loop_name(requested) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
