"""run_all: several choices' streams merged into one on_delta; the first failure ends them
all (services/router/requests/lifecycle.py)."""

import asyncio

import pytest

from services.router.requests.lifecycle import run_all


async def _choice(items, delay=0.0, fail=None, closed=None):
    """A run as the lifecycle builds them: `run(on_delta)`."""

    async def runner(on_delta):
        try:
            for item in items:
                await asyncio.sleep(delay)
                on_delta(item)
            if fail:
                raise fail
        finally:
            if closed is not None:
                closed.append(items[0])

    return runner


async def test_run_all_hands_on_every_delta_of_every_choice():
    out = []
    await run_all([await _choice([1, 2, 3], 0.001), await _choice([10, 20], 0.002)], out.append)
    assert sorted(out) == [1, 2, 3, 10, 20]


async def test_run_all_raises_the_first_error_and_ends_every_choice():
    closed = []
    choices = [await _choice([1], fail=ValueError("boom"), closed=closed),
               await _choice(list(range(100, 200)), 0.01, closed=closed)]  # fmt: skip
    with pytest.raises(ValueError, match="boom"):
        await run_all(choices, lambda _d: None)
    assert sorted(closed) == [1, 100]


async def test_an_error_in_on_delta_stops_the_choices():
    closed = []

    def on_delta(d):
        if d == 2:
            raise ConnectionResetError("client gone")

    choices = [await _choice([1, 2, 3], 0.001, closed=closed),
               await _choice(list(range(50, 60)), 0.01, closed=closed)]  # fmt: skip
    with pytest.raises(ConnectionResetError):
        await run_all(choices, on_delta)
    assert sorted(closed) == [1, 50]
