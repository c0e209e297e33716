"""The router's view of its workers' liveness (issue 39): its own stalls are not their
silence (LoopClock), and a worker out of rotation keeps its KV index entries until it is
really gone (WorkerTable.forget). Pure Python, an injected clock; milliseconds."""

import pytest

from services.router.routing.loop_clock import LoopClock
from services.router.routing.workers import WorkerTable
from tests.router.test_router_policy import report


class Base:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_loop_clock_runs_like_the_base_clock_while_ticks_come_on_time():
    base = Base()
    clock = LoopClock(0.25, base)
    start = clock()
    for _ in range(8):
        base.now += 0.25
        assert clock.tick() == 0.0
    assert clock() - start == pytest.approx(2.0)


def test_loop_clock_stands_still_during_a_stall_and_excuses_it_after():
    base = Base()
    clock = LoopClock(0.25, base)
    start = clock()
    base.now += 10.0  # the loop was blocked: no tick for 10 s
    assert clock() - start == pytest.approx(0.25)  # stands still while the stall lasts
    assert clock.tick() == pytest.approx(9.75)
    assert clock() - start == pytest.approx(0.25)  # no jump when the tick comes
    base.now += 0.25
    clock.tick()
    assert clock() - start == pytest.approx(0.5) and clock.stalled == pytest.approx(9.75)


def test_loop_clock_refuses_a_period_of_zero():
    with pytest.raises(ValueError, match="period"):
        LoopClock(0.0)


def test_a_stalled_router_prunes_no_worker_that_kept_reporting():
    base = Base()
    clock = LoopClock(0.25, base)
    table = WorkerTable(timeout=3.0, clock=clock, forget_timeout=30.0)
    table.update(report("b1", "both"))
    base.now += 10.0  # the router's loop stalls 10 s; b1's reports queue up unread
    assert [w.id for w in table.live("both")] == ["b1"] and table.prune() == []
    clock.tick()
    assert table.prune() == [] and table.ready()
    base.now += 0.25
    clock.tick()
    table.update(report("b1", "both"))  # the queued reports are read
    assert table.ready()


def test_a_worker_silent_while_the_router_runs_is_still_pruned():
    base = Base()
    clock = LoopClock(0.25, base)
    table = WorkerTable(timeout=3.0, clock=clock, forget_timeout=30.0)
    table.update(report("b1", "both"))
    for _ in range(11):  # 2.75 s of a loop on time
        base.now += 0.25
        clock.tick()
    assert table.prune() == []
    base.now += 0.25
    clock.tick()
    assert [w.id for w in table.prune()] == ["b1"] and not table.ready()


def test_a_pruned_worker_is_forgotten_only_after_the_forget_timeout():
    base = Base()
    table = WorkerTable(timeout=3.0, clock=base, forget_timeout=30.0)
    table.update(report("d1", "decode"))
    base.now += 3.0
    assert [w.id for w in table.prune()] == ["d1"]
    assert table.forget() == [] and table.live("decode") == []
    base.now += 26.9
    assert table.forget() == []
    base.now += 0.1
    assert [w.id for w in table.forget()] == ["d1"] and table.forget() == []


def test_a_pruned_worker_back_as_the_same_instance_rejoins_and_is_never_forgotten():
    base = Base()
    table = WorkerTable(timeout=3.0, clock=base, forget_timeout=30.0)
    table.update(report("d1", "decode", instance="a"))
    base.now += 5.0
    assert [w.id for w in table.prune()] == ["d1"]
    assert table.update(report("d1", "decode", instance="a")) is True  # rejoined
    assert [w.id for w in table.live("decode")] == ["d1"]
    base.now += 60.0
    assert table.forget() == []


def test_a_pruned_worker_back_as_another_instance_is_forgotten_at_once():
    base = Base()
    table = WorkerTable(timeout=3.0, clock=base, forget_timeout=30.0)
    table.update(report("d1", "decode", instance="a"))
    base.now += 5.0
    table.prune()
    assert table.update(report("d1", "decode", instance="b")) is True
    forgotten = table.forget()
    assert [(w.id, w.report.instance) for w in forgotten] == [("d1", "a")]
    assert table.is_live("d1", "b") and table.forget() == []


def test_without_a_forget_timeout_a_pruned_worker_is_forgotten_at_the_next_call():
    base = Base()
    table = WorkerTable(timeout=3.0, clock=base)
    table.update(report("d1", "decode"))
    base.now += 3.0
    table.prune()
    assert [w.id for w in table.forget()] == ["d1"]
