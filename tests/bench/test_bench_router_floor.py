"""bench.router's floor: a real aiohttp process and the lean client; every event of every
stream is read and timed, and the verdicts compare the router's figures with the floor's."""

from __future__ import annotations

import math

from bench import router_floor
from bench.router_floor import verdicts


async def test_the_floor_times_every_request_and_every_event():
    floor = await router_floor.measure([1, 4], rounds=2, max_tokens=3)
    assert set(floor) == {"1", "4"}
    for streams, level in ((1, floor["1"]), (4, floor["4"])):
        assert level["requests"] == 2 * streams and level["events"] == 2 * streams * 3
        for key in ("front_p50_ms", "front_p99_ms", "hold_p50_ms", "hold_p99_ms"):
            assert math.isfinite(level[key]) and level[key] > 0
        assert level["front_p50_ms"] <= level["front_p99_ms"]
        assert level["hold_p50_ms"] <= level["hold_p99_ms"]


def test_verdicts_say_met_not_met_and_when_the_goal_is_under_the_floor():
    result = {
        "levels": {
            "1": {"paired_added_ms_per_request_p50": 1.2, "paired_added_ms_per_token_p50": 0.2},
            "64": {"paired_added_ms_per_request_p50": 40.0, "paired_added_ms_per_token_p50": 4.0},
        },
        "floor": {
            "1": {"front_p50_ms": 0.3, "hold_p50_ms": 0.25},
            "64": {"front_p50_ms": 8.5, "hold_p50_ms": 0.4},
        },
    }
    lines = verdicts(result)
    assert len(lines) == 4
    assert "per request: 1.20 ms (goal < 3.0): met" in lines[0]
    assert "under the floor" not in lines[0]
    assert "per token: 0.20 ms (goal < 0.5): met" in lines[1]
    assert "not met" in lines[2] and "the goal is under the floor" in lines[2]
    assert "not met" in lines[3] and "under the floor" not in lines[3]  # 0.4 < 0.5: reachable
