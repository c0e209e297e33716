"""Waiting for several calls at once without leaving any behind."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any


async def gather_all(aws: Iterable[Awaitable]) -> list[Any]:
    """asyncio.gather that cancels (and waits for) the others when one fails."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
