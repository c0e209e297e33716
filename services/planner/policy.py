"""How many prefill and decode workers the cluster needs: pure policy, no I/O, no clock.

Inputs are what the workers publish (`LoadReport`, summed per role by `RoleLoad.of`), the
capacity of one worker as measured on the engine (`Capacity`, from `python -m bench.plan
--measure`), the SLOs and the bounds. The decision is the count each role should run.

Prefill: predicted TTFT = queue time + prefill time. A prompt's own prefill takes
`mean_prompt_tokens / rate`, which leaves `wait` of the SLO (times `ttft_headroom`) for its
queue. Four counts, the planner takes the largest:

- keep up: prompt tokens arriving per second / (rate * `utilization`);
- queueing: the fewest workers at which the share of prompts that wait longer than `wait`
  is at most `late_share`, as an M/M/c queue predicts (Erlang C, `late_share_of`; offered
  load = arriving prompt tokens / rate). A prompt waits whenever every worker is busy, and
  one long prompt keeps a worker busy for seconds: at low load a fixed utilization
  leaves too few workers for that, at high load it is the larger count;
- drain: the backlog a worker asked for now would still find when it serves, after
  `startup_s` (prompts stay queued where they were sent): backlog / (rate * (startup + wait));
- behind: the queue time the workers measure (the oldest waiting request's, not inferred
  from finished requests: a queue shows here before any TTFT does) past `wait`: one more
  worker than now, every decision until it is back under;
- late: the TTFT the workers observed (p90 over their last seconds, arrival on the worker
  to first token) past the SLO: one more worker than those reporting. The counts above
  rest on the measured `Capacity`; this one does not, so a capacity figure that is wrong
  for this host (other hardware, longer prompts than planned) still gets workers added.

Decode: its step time grows with the batch (`step = base + per_seq * batch`), and ITL is
the step time. Two counts and the pages, the planner takes the largest:

- now: the fewest `d` whose per-worker batch (running plus waiting, plus the prompts
  prefill workers are computing now, spread over `d`) keeps the step within the ITL SLO
  (times `itl_headroom`), and within each worker's seats. Prompts still queued on prefill
  workers are not counted: they reach decode one prompt time apart per prefill worker,
  while the sequences in decode finish, so they are never all in one batch;
- flow: what the prefill workers can hand over. A burst reaches decode sooner than a new
  worker starts, but no faster than the prefill workers (those reporting, or the count
  asked for if more) compute prompts: `f` = prefill workers * rate / `mean_prompt_tokens`
  requests a second, each `mean_output_tokens`
  steps long. A worker given `f / d` of them a second holds a batch `b` with
  `b = (f / d) * out * (base + per_seq * b)` (Little's law), its step within the SLO
  while `d >= f * out * per_seq / (1 - base / itl)`. Prefill sized for queueing (long
  prompts, the Erlang C count) is seldom flat out, so once the planner has seen
  `flow_window_s` of arrivals, `f` is at most their peak (`ArrivalPeak`: prompt tokens a
  second averaged over `startup_s`, the highest of the window): decode is sized for the
  largest burst of the window, not for a flat-out prefill that never comes. A larger
  burst than any of the window is met by the counts above as it arrives (prompts being
  prefilled count in `now`). The cap rests on the capacity model: once a decode worker
  observes its ITL p90 past the SLO, the model is not trusted with it again (the planner
  logs it once; re-measure, then restart the planner). `flow_window_s = 0`: always flat
  out;
- slow: the time between tokens the workers observed (p90) past the ITL SLO: one more
  worker than those reporting (as `late` for prefill).

Scaling up happens at once; scaling down waits until the smaller count has been enough for
`scale_down_after_s` without a break, and goes one worker at a time (`Hysteresis`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.common.messages.control import LoadReport

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleLoad:
    """One role's live workers, summed (`queue_time_s`: the longest wait among them)."""

    workers: int = 0
    waiting: int = 0
    running: int = 0
    waiting_prefill_tokens: int = 0
    queue_time_s: float = 0.0
    prompt_tokens_per_s: float = 0.0  # prompt tokens accepted per second (arrivals)
    used_pages: int = 0
    total_pages: int = 0
    max_running: int = 0
    ttft_p90_s: float = 0.0  # the worst worker's observed p90s (0: none observed)
    itl_p90_s: float = 0.0

    @classmethod
    def of(cls, reports: Iterable[LoadReport]) -> RoleLoad:
        reports = list(reports)
        return cls(
            workers=len(reports),
            waiting=sum(r.waiting for r in reports),
            running=sum(r.running for r in reports),
            waiting_prefill_tokens=sum(r.waiting_prefill_tokens for r in reports),
            queue_time_s=max((r.queue_time_s for r in reports), default=0.0),
            prompt_tokens_per_s=sum(r.prompt_tokens_per_s for r in reports),
            used_pages=sum(r.total_pages - r.free_pages for r in reports),
            total_pages=sum(r.total_pages for r in reports),
            max_running=sum(r.max_running for r in reports),
            ttft_p90_s=max((r.ttft_p90_s for r in reports), default=0.0),
            itl_p90_s=max((r.itl_p90_s for r in reports), default=0.0),
        )


def loads_by_role(reports: Iterable[LoadReport]) -> dict[str, RoleLoad]:
    """Reports of `prefill` and `decode` workers summed per role (`both` counts as decode)."""
    by_role: dict[str, list[LoadReport]] = {role: [] for role in ROLES}
    for r in reports:
        by_role["decode" if r.role == "both" else r.role].append(r)
    return {role: RoleLoad.of(rs) for role, rs in by_role.items()}


@dataclass(frozen=True)
class Capacity:
    """One worker's throughput, measured on the engine (bench.plan --measure)."""

    prefill_tokens_per_s: float
    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_seats: int  # --max-num-seqs of a decode worker

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_seats < 1:
            raise ValueError("capacity: prefill rate must be > 0 and seats >= 1")
        if self.decode_step_base_s <= 0 or self.decode_step_per_seq_s < 0:
            raise ValueError("capacity: decode step base must be > 0, per-seq >= 0")

    def step_s(self, batch: float) -> float:
        return self.decode_step_base_s + self.decode_step_per_seq_s * batch

    def batch_within(self, itl_s: float) -> int:
        """The largest batch whose step fits `itl_s` (at least 1), capped by the seats."""
        if self.decode_step_per_seq_s == 0:
            return self.decode_seats
        fits = math.floor((itl_s - self.decode_step_base_s) / self.decode_step_per_seq_s)
        return max(1, min(self.decode_seats, fits))


@dataclass(frozen=True)
class Targets:
    """SLOs, bounds and margins (the planner's flags)."""

    ttft_s: float
    itl_s: float
    min_workers: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    max_workers: dict[str, int] = field(default_factory=lambda: {"prefill": 4, "decode": 4})
    # Plan for this fraction of each SLO (decode's bursts are the flow count's).
    ttft_headroom: float = 0.7
    itl_headroom: float = 1.0
    utilization: float = 0.6  # plan each worker busy at most this fraction of the time
    mean_prompt_tokens: float = 512.0  # a prompt's own compute in the prediction
    mean_output_tokens: float = 128.0  # a request's decode steps (the flow count)
    late_share: float = 0.05  # of prompts planned to wait past the budget: half a p90's 10%
    max_page_use: float = 0.9
    startup_s: float = 10.0  # from asking for a worker to its first request served
    flow_window_s: float = 600.0  # arrivals whose peak caps decode's flow count (0: none)

    def clamp(self, role: str, n: int) -> int:
        return max(self.min_workers[role], min(self.max_workers[role], n))


def late_share_of(workers: int, offered: float, wait_in_services: float) -> float:
    """M/M/c (Erlang C): the share of arrivals that wait longer than `wait_in_services`
    mean service times at `workers` servers; `offered` = arrival rate x mean service time."""
    if offered <= 0:
        return 0.0
    if workers <= offered:
        return 1.0
    blocked = 1.0  # Erlang B, by its recurrence over the number of servers
    for k in range(1, workers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    waits = workers * blocked / (workers - offered * (1 - blocked))
    return waits * math.exp(-(workers - offered) * wait_in_services)


def fewest_workers(offered: float, wait_in_services: float, share: float, most: int) -> int:
    """The fewest workers (up to `most`) at which at most `share` wait past the budget."""
    if offered <= 0:
        return 0
    n = max(1, math.floor(offered))
    while n < most and late_share_of(n, offered, wait_in_services) > share:
        n += 1
    return n


def prefill_needed(load: RoleLoad, cap: Capacity, t: Targets) -> int:
    """The fewest prefill workers whose predicted TTFT fits the SLO (see the module doc)."""
    rate = cap.prefill_tokens_per_s
    keep_up = math.ceil(load.prompt_tokens_per_s / (rate * t.utilization))
    wait = max(1e-3, t.ttft_s * t.ttft_headroom - t.mean_prompt_tokens / rate)
    offered, service_s = load.prompt_tokens_per_s / rate, t.mean_prompt_tokens / rate
    most = t.max_workers["prefill"]
    queueing = fewest_workers(offered, wait / service_s, t.late_share, most)
    # A worker asked for now serves after `startup_s`: only the backlog left by then is
    # its work (queued prompts stay on the worker they were sent to).
    drain = math.ceil(load.waiting_prefill_tokens / (rate * (t.startup_s + wait)))
    # Waited past the budget already: the backlog figure is behind, one more than now.
    behind = load.workers + 1 if load.queue_time_s > wait else 0
    late = load.workers + 1 if load.ttft_p90_s > t.ttft_s and load.waiting else 0
    return t.clamp("prefill", max(keep_up, queueing, drain, behind, late))


def decode_flow_needed(
    prefill_workers: int, cap: Capacity, t: Targets, peak_tokens_per_s: float | None = None
) -> int:
    """The fewest decode workers that keep the ITL SLO under all the requests a second
    `prefill_workers` computing at full speed hand over, or only those of the arrivals'
    peak (prompt tokens a second) when it is known and lower (see the module doc)."""
    tokens_per_s = prefill_workers * cap.prefill_tokens_per_s
    if peak_tokens_per_s is not None:
        tokens_per_s = min(tokens_per_s, peak_tokens_per_s)
    flow = tokens_per_s / t.mean_prompt_tokens
    room = 1 - cap.decode_step_base_s / t.itl_s
    if room <= 0:
        return t.max_workers["decode"]
    return math.ceil(flow * t.mean_output_tokens * cap.decode_step_per_seq_s / room)


def decode_needed(
    load: RoleLoad,
    cap: Capacity,
    t: Targets,
    incoming: int = 0,
    prefill_workers: int = 0,
    peak_tokens_per_s: float | None = None,
) -> int:
    """The fewest decode workers whose batch keeps the step within the ITL SLO, with seats
    and pages for every running and waiting sequence, and the `incoming` ones (prompts
    prefill workers compute now: they reach decode sooner than a new worker starts), and
    for what `prefill_workers` can hand over (at most the arrivals' peak, when known)."""
    sequences = load.running + load.waiting + incoming
    per_worker = cap.batch_within(t.itl_s * t.itl_headroom)
    flow = decode_flow_needed(prefill_workers, cap, t, peak_tokens_per_s)
    by_itl = max(math.ceil(sequences / per_worker), flow)
    by_pages = 0
    if load.total_pages and load.workers:
        pages_per_worker = load.total_pages / load.workers
        by_pages = math.ceil(load.used_pages / (pages_per_worker * t.max_page_use))
    queued = load.workers + 1 if load.waiting and load.queue_time_s > t.itl_s else 0
    slow = load.workers + 1 if load.itl_p90_s > t.itl_s else 0
    return t.clamp("decode", max(by_itl, by_pages, queued, slow))


def needed(
    loads: dict[str, RoleLoad], cap: Capacity, t: Targets, peak_tokens_per_s: float | None = None
) -> dict[str, int]:
    """The worker count each role needs for these loads (before hysteresis)."""
    prefill = loads["prefill"]
    n = prefill_needed(prefill, cap, t)
    decode = decode_needed(loads["decode"], cap, t, prefill.running, max(n, prefill.workers),
                           peak_tokens_per_s)  # fmt: skip
    return {"prefill": n, "decode": decode}


@dataclass
class ArrivalPeak:
    """The highest arrival rate of the last `window_s`: prompt tokens a second (the prefill
    workers' reports summed, one sample a decision), averaged over `over_s`, the highest
    such mean in the window. `peak` is None until the samples span `window_s`: a planner
    just started has not seen the traffic's bursts yet, and plans for prefill flat out."""

    window_s: float
    over_s: float
    _recent: deque[tuple[float, float]] = field(default_factory=deque)  # (at, rate)
    _means: deque[tuple[float, float]] = field(default_factory=deque)  # (at, mean)
    _first: float | None = None

    def add(self, now: float, tokens_per_s: float) -> None:
        if self._first is None:
            self._first = now
        self._recent.append((now, tokens_per_s))
        while self._recent[0][0] < now - self.over_s:
            self._recent.popleft()
        mean = sum(rate for _, rate in self._recent) / len(self._recent)
        self._means.append((now, mean))
        while self._means[0][0] < now - self.window_s:
            self._means.popleft()

    def peak(self, now: float) -> float | None:
        if self.window_s <= 0 or self._first is None or now - self._first < self.window_s:
            return None
        return max(mean for _, mean in self._means)


@dataclass
class Hysteresis:
    """Up at once; down one worker at a time, after `scale_down_after_s` of enough."""

    scale_down_after_s: float
    _low_since: dict[str, float] = field(default_factory=dict)

    def decide(self, current: dict[str, int], want: dict[str, int], now: float) -> dict[str, int]:
        out = dict(current)
        for role, n in want.items():
            if n >= current[role]:
                self._low_since.pop(role, None)
                out[role] = n
                continue
            since = self._low_since.setdefault(role, now)
            if now - since >= self.scale_down_after_s:
                out[role] = current[role] - 1
                self._low_since[role] = now  # the next step down waits again
        return out


@dataclass(frozen=True)
class Decision:
    counts: dict[str, int]  # what each role should run now (after hysteresis)
    needed: dict[str, int]  # what the loads alone ask for
    loads: dict[str, RoleLoad]
    peak_tokens_per_s: float | None = None  # the arrivals' peak capping decode's flow count


@dataclass
class Planner:
    """The decision function the service and the simulator share."""

    capacity: Capacity
    targets: Targets
    hysteresis: Hysteresis
    arrivals: ArrivalPeak = field(init=False)
    # When a decode worker first observed its ITL p90 past the SLO: from then on the
    # arrivals' peak no longer caps decode's flow count (it rests on the capacity model).
    decode_model_wrong_at: float | None = None

    def __post_init__(self) -> None:
        self.arrivals = ArrivalPeak(self.targets.flow_window_s, self.targets.startup_s)

    def decide(
        self, reports: Iterable[LoadReport], current: dict[str, int], now: float
    ) -> Decision:
        loads = loads_by_role(reports)
        self.arrivals.add(now, loads["prefill"].prompt_tokens_per_s)
        if self.decode_model_wrong_at is None and loads["decode"].itl_p90_s > self.targets.itl_s:
            self.decode_model_wrong_at = now
        peak = self.arrivals.peak(now) if self.decode_model_wrong_at is None else None
        want = needed(loads, self.capacity, self.targets, peak)
        return Decision(self.hysteresis.decide(current, want, now), want, loads, peak)
