"""The scheduler: budgets, FCFS, prefix reuse, preemption, page conservation."""

from __future__ import annotations

import random
import time

import pytest

from libs.common.engine.core.kv_hash import PageHasher
from libs.common.engine.core.page_allocator import PageAllocator
from libs.common.engine.core.radix_cache import RadixCache
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.scheduler import Scheduler, SchedulerOutput
from libs.common.engine.core.sequence import FinishReason, Sequence, SequenceStatus

PAGE = 4
EOS = 2


def make(pages: int = 64, seqs: int = 8, budget: int = 32, cache: bool = True) -> Scheduler:
    return Scheduler(
        PageAllocator(pages),
        page_size=PAGE,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        cache=RadixCache(PAGE) if cache else None,
        hasher=PageHasher("test-model", "float32", PAGE) if cache else None,
        eos_token_ids=[EOS],
    )


def seq(rid: str, n: int, max_tokens: int = 8, first: int = 100, **kw) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Sequence(rid, list(range(first, first + n)), params)


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    out = s.schedule()
    sampled = {x.seq.request_id: token for x in out.scheduled if x.sample}
    return out, s.postprocess(out, sampled)


def run_until_done(s: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("scheduler did not drain")


def assert_pages_conserved(s: Scheduler) -> None:
    """Every page is exactly one of: free, cached, or owned by one live sequence;
    and each cached page has exactly one reference per live sequence using it."""
    live = list(s._seqs.values())
    own = [p for q in live for p in q.page_table[q.num_committed_pages :]]
    cache = s.kv.cache
    cached = [n.page for n in cache._nodes.values()] if cache else []
    used = own + cached
    assert len(used) == len(set(used))
    assert len(used) + s.kv.allocator.num_free == s.kv.allocator.num_pages
    if cache:
        users: dict[str, int] = {}
        for q in live:
            for key in q.page_keys[: q.num_committed_pages]:
                users[key] = users.get(key, 0) + 1
        assert {k: n.ref for k, n in cache._nodes.items() if n.ref} == users


def test_chunked_prefill_never_exceeds_the_token_budget():
    s = make(budget=16)
    for i in range(3):
        s.add(seq(f"r{i}", 37, first=1000 * i))
    for _ in range(20):
        out, _ = step(s)
        assert out.num_batched_tokens <= 16


def test_a_long_prompt_is_prefilled_in_chunks_then_decodes():
    s = make(budget=16)
    s.add(seq("r", 40))
    chunks = [step(s)[0].scheduled[0] for _ in range(4)]
    assert [(c.start, c.num_tokens, c.sample) for c in chunks] == [
        (0, 16, False),
        (16, 16, False),
        (32, 8, True),
        (40, 1, True),
    ]
    assert chunks[-1].is_decode


def test_waiting_sequences_are_admitted_in_arrival_order():
    s = make(seqs=2)
    for rid in ("a", "b", "c", "d"):
        s.add(seq(rid, 5, first=ord(rid) * 100))
    out, _ = step(s)
    assert [x.seq.request_id for x in out.scheduled] == ["a", "b"]


def test_the_head_of_the_queue_is_never_overtaken():
    s = make(pages=8, cache=False)
    s.add(seq("big", 20, max_tokens=4))  # 6 pages
    step(s)
    s.add(seq("huge", 28, max_tokens=4))  # 8 pages: must wait for big
    s.add(seq("small", 3, max_tokens=1))  # would fit, but arrived later
    out, _ = step(s)
    assert [x.seq.request_id for x in out.scheduled] == ["big"]


def test_running_sequences_never_exceed_max_num_seqs():
    s = make(seqs=3, budget=64)
    for i in range(10):
        s.add(seq(f"r{i}", 6, first=100 * i))
    for _ in range(30):
        step(s)
        assert s.num_running <= 3


def test_running_decodes_are_not_starved_by_a_long_prompt():
    s = make(budget=8)
    s.add(seq("chat", 3, max_tokens=20))
    step(s)
    s.add(seq("long", 60, first=900))
    for _ in range(5):
        out, _ = step(s)
        assert out.scheduled[0].seq.request_id == "chat" and out.scheduled[0].is_decode
        assert out.num_batched_tokens == 8


def test_a_prefix_match_never_covers_the_whole_sequence():
    s = make()
    s.add(seq("a", 8, max_tokens=1))  # exactly two full pages
    run_until_done(s)
    s.add(seq("b", 8, max_tokens=1))
    out, _ = step(s)
    item = out.scheduled[0]
    assert (item.start, item.num_tokens) == (4, 4)  # page 2 is recomputed for its logits
    assert s.get("b") is None and item.seq.num_cached_tokens == 4


def test_a_prefix_hit_reuses_the_cached_pages():
    s = make()
    s.add(seq("a", 13, max_tokens=1))
    run_until_done(s)
    s.add(b := seq("b", 13, max_tokens=4))
    out, _ = step(s)
    assert out.scheduled[0].start == 12 and b.num_cached_tokens == 12
    assert s.kv.cache.stats.hit_pages == 3


def test_preemption_frees_the_newest_sequence_and_requeues_it_first():
    s = make(pages=6, budget=64, cache=False)
    s.add(old := seq("old", 8, max_tokens=16))
    s.add(new := seq("new", 8, max_tokens=16, first=500))
    step(s)  # both prefilled: 4 pages used; each decode now needs a fifth page
    s.add(seq("later", 3, first=900))  # fits in one page, but must not be admitted
    s.kv.alloc(1)  # squeeze: one page left for two sequences that each need one
    out, _ = step(s)
    assert out.preempted == [new] and new.page_table == []
    assert new.status == SequenceStatus.PREEMPTED and new.num_computed_tokens == 0
    assert [q.request_id for q in s.waiting] == ["new", "later"]
    assert [x.seq for x in out.scheduled] == [old]
    assert s.kv.allocator.num_free == 2  # new's two pages came back


def test_a_preempted_sequence_keeps_its_tokens_and_is_recomputed():
    s = make(pages=6, budget=64, cache=False)
    s.add(seq("old", 8, max_tokens=12))
    s.add(new := seq("new", 8, max_tokens=12, first=500))
    step(s)
    hog = s.kv.alloc(1)
    step(s)
    tokens = list(new.token_ids)
    s.kv.allocator.free(hog)
    run_until_done(s)
    assert new.token_ids[: len(tokens)] == tokens and new.num_output_tokens == 12
    assert new.num_preemptions >= 1


def test_finished_sequences_leave_every_page_free_or_cached():
    s = make()
    for i in range(5):
        s.add(seq(f"r{i}", 10 + i, max_tokens=6, first=100 * i))
    run_until_done(s)
    assert s.num_free_pages == 64
    assert_pages_conserved(s)


@pytest.mark.parametrize("state", ["waiting", "running", "held", "reserved"])
def test_abort_frees_the_pages_in_any_state(state: str):
    s = make()
    q = seq("r", 10)
    if state == "reserved":
        s.reserve(q)
    else:
        q.keep_pages = state == "held"
        s.add(q)
        if state != "waiting":
            step(s)
        if state == "held":
            s.finish("r", FinishReason.STOP)
    assert s.abort("r") is q
    assert q.status == SequenceStatus.FINISHED and q.page_table == []
    assert s.num_free_pages == 64 and not s.has_work()


def test_a_prefill_only_sequence_holds_its_pages_until_released():
    s = make()
    s.add(q := Sequence("p", list(range(10)), SamplingParams(max_tokens=50), prefill_only=True))
    _, done = step(s)
    assert done == [q] and q.status == SequenceStatus.HELD and q.finish_reason is None
    assert q.num_output_tokens == 1 and len(q.page_table) == 3
    assert s.num_free_pages == 64 - 3  # its two full pages are cached, but referenced
    s.release("p")
    assert q.status == SequenceStatus.FINISHED and s.num_free_pages == 64


def test_an_imported_sequence_starts_in_decode():
    s = make()
    q = seq("d", 10, max_tokens=3)
    pages = s.reserve(q)
    assert len(pages) == 3 and q.status == SequenceStatus.RESERVED
    s.add_imported("d", 42)
    out, _ = step(s)
    item = out.scheduled[0]
    assert (item.start, item.num_tokens, item.is_decode) == (10, 1, True)
    assert item.token_ids == [42] and q.page_table[2] == pages[2]


def test_max_tokens_stop_ids_and_eos_end_generation():
    s = make()
    s.add(a := seq("a", 3, max_tokens=2))
    s.add(b := seq("b", 3, max_tokens=9, first=200, stop_token_ids=[7]))
    s.add(c := seq("c", 3, max_tokens=3, first=300, ignore_eos=True))
    step(s)
    step(s)
    assert a.finish_reason == FinishReason.LENGTH and a.num_output_tokens == 2
    assert b.finish_reason == FinishReason.STOP and b.num_output_tokens == 1
    s.add(d := seq("d", 3, max_tokens=9, first=400))
    step(s, token=EOS)
    assert d.finish_reason == FinishReason.STOP
    assert c.finish_reason == FinishReason.LENGTH  # EOS ignored


def test_identical_concurrent_prompts_end_up_sharing_pages():
    s = make()
    s.add(a := seq("a", 9, max_tokens=4))
    s.add(b := seq("b", 9, max_tokens=4))
    step(s)  # both computed in the same step: b's full pages are duplicates
    assert a.page_table[:2] == b.page_table[:2]
    assert_pages_conserved(s)


def test_a_sequence_larger_than_the_pool_is_rejected():
    with pytest.raises(ValueError, match="pages"):
        make(pages=4).add(seq("r", 10, max_tokens=10))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pages_are_conserved_under_a_random_workload(seed: int):
    rng = random.Random(seed)
    s = make(pages=24, seqs=6, budget=24)
    shared = list(range(500, 512))
    for i in range(300):
        prompt = shared[: rng.randint(1, 12)] + [rng.randint(0, 99) for _ in range(8)]
        q = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)))
        q.keep_pages = rng.random() < 0.2
        roll = rng.random()
        if roll < 0.25:
            s.add(q)
        elif roll < 0.3 and s.reserve(q) is not None:
            s.add_imported(q.request_id, rng.randint(0, 99))
        if rng.random() < 0.05 and s._seqs:
            s.abort(rng.choice(list(s._seqs)))
        for held in [q for q in s._seqs.values() if q.status == SequenceStatus.HELD]:
            s.release(held.request_id)
        step(s, token=rng.choice([7, 8, EOS]))
        assert_pages_conserved(s)
    assert s.kv.cache.stats.hit_pages > 0


def test_abort_with_retired_pages_never_hands_the_reserved_pages_out_again():
    s = make()
    first = seq("cached", 12)  # its 3 full pages end up in the prefix cache
    s.add(first)
    run_until_done(s)
    q = seq("r", 21)  # shares the first 3 pages (12 tokens), 3 more of its own
    pages = s.reserve(q, reuse_prefix=True)
    held = q.num_committed_pages
    assert held == 3 and len(pages) == 6
    free_before = s.num_free_pages
    assert s.abort("r", retire_pages=True) is q
    assert s.retired_pages == 3
    # The cached prefix pages are released (evictable again); its own pages stay out.
    assert s.num_free_pages == free_before + held
    for i in range(20):  # none of them is ever allocated again
        other = seq(f"o{i}", 8, first=1000 + 10 * i)
        got = s.reserve(other)
        assert got is not None and not set(got) & set(pages[held:])
        s.abort(f"o{i}")


def test_queue_time_ends_at_the_first_step_once():
    s = make(seqs=1, budget=64)
    first, second = seq("q1", 6), seq("q2", 6, first=300)
    s.add(first)
    s.add(second)
    assert first.queue_time is None and second.queue_time is None
    step(s)  # one seat: only q1 runs
    assert first.queue_time is not None and first.queue_time >= 0
    assert second.queue_time is None  # still waiting
    ran = first.scheduled_time
    run_until_done(s)
    assert first.scheduled_time == ran  # set once, at its first step
    assert second.scheduled_time is not None and ran is not None
    assert second.scheduled_time >= ran


def test_a_handed_over_sequence_queues_from_its_import_not_its_reservation():
    """The handoff (reserved, the prefill worker writing its KV) is no queueing: a decode
    worker's `decode.queue` span and its load report's oldest wait start at the import."""
    s = make()
    q = Sequence("d", list(range(100, 110)), SamplingParams(max_tokens=3), arrival_time=0.0)
    s.reserve(q)
    s.add_imported("d", 42)
    imported = time.monotonic()
    assert q.queued_time > q.arrival_time and s.oldest_wait(imported) < 1.0
    step(s)
    assert q.queue_time is not None and 0.0 <= q.queue_time < 1.0


def test_oldest_wait_is_the_longest_wait_among_waiting_sequences_only():
    """What a worker's load report carries as queue_time_s (the planner's input)."""
    s = make(seqs=1)
    assert s.oldest_wait(100.0) == 0.0
    s.add(Sequence("a", [100, 101], SamplingParams(max_tokens=4), arrival_time=10.0))
    s.add(Sequence("b", [102, 103], SamplingParams(max_tokens=4), arrival_time=40.0))
    assert s.oldest_wait(100.0) == 90.0
    step(s)  # one seat: "a" runs, "b" still waits
    assert s.num_running == 1 and s.oldest_wait(100.0) == 60.0
