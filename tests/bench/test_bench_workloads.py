"""Workload construction: trace prompts share blocks exactly where hash_ids are equal."""

from __future__ import annotations

import json

import pytest

from bench.workloads import MultiTurn, TraceReplay


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_prompts_share_words_exactly_where_hash_ids_are_equal(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1536, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1200, "output_length": 50, "hash_ids": [0, 1, 7]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 5, "hash_ids": [9, 1]},
    ])  # fmt: skip
    replay = TraceReplay(trace, block_len=8, output_scale=0.1, time_scale=0.5)
    a, b, c = (t.messages[0]["content"].split() for t in replay.turns)
    assert (len(a), len(b), len(c)) == (24, 19, 16)  # 1200 * 8/512 = 18.75 -> 19
    assert a[:16] == b[:16] and a[16:] != b[16:19]
    assert c[8:16] == a[8:16] and c[:8] != a[:8]  # block 1 is the same wherever it sits
    assert [t.at for t in replay.turns] == [0.0, 0.25, 1.0]
    assert [t.max_tokens for t in replay.turns] == [10, 5, 1]


def test_trace_replay_is_bounded_by_max_requests_and_max_input(tmp_path):
    rows = [{"timestamp": i, "input_length": 5120, "output_length": 1, "hash_ids": list(range(10))}
            for i in range(50)]  # fmt: skip
    replay = TraceReplay(write_trace(tmp_path / "t.jsonl", rows), block_len=16, max_requests=7,
                         max_input=40)  # fmt: skip
    assert replay.total == 7
    assert all(len(t.messages[0]["content"].split()) == 40 for t in replay.turns)


def test_real_trace_loads_when_present():
    from bench.serve import DEFAULT_TRACE

    if not DEFAULT_TRACE.exists():
        pytest.skip(f"{DEFAULT_TRACE} not here")
    replay = TraceReplay(DEFAULT_TRACE, block_len=16, max_requests=20)
    first = [t.messages[0]["content"].split()[:16] for t in replay.turns]
    assert all(f == first[0] for f in first)  # every request of the trace starts with block 0


def test_multi_turn_without_barrier_releases_a_clients_next_round_at_once():
    w = MultiTurn(2, 3, 5, 5, 2)
    t0, t1 = w.initial()
    (nxt,) = w.done(t0, True, "answer")
    assert (nxt.client, nxt.round) == (0, 1)
    assert nxt.messages[1] == {"role": "assistant", "content": "answer"}
    assert w.done(t1, False, "") == []  # a failed client's conversation ends


def test_multi_turn_barrier_holds_the_round_until_all_clients_finish():
    w = MultiTurn(2, 2, 5, 5, 2, barrier=True)
    t0, t1 = w.initial()
    assert w.done(t0, True, "a") == []
    released = w.done(t1, True, "b")
    assert sorted((t.client, t.round) for t in released) == [(0, 1), (1, 1)]


@pytest.mark.parametrize("kwargs, flag", [
    ({"clients": 0}, "--num-clients"), ({"output_len": 0}, "--output-len"),
    ({"range_ratio": 1.0}, "--range-ratio"),
])  # fmt: skip
def test_bad_multi_turn_arguments_name_the_flag(kwargs, flag):
    args = {"clients": 1, "rounds": 1, "request_len": 1, "question_len": 1, "output_len": 1}
    with pytest.raises(ValueError, match=flag):
        MultiTurn(**{**args, **kwargs})
