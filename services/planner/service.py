"""The planner service: load reports in, a decision every --interval, an actuator out.

It subscribes to `<prefix>.workers.*.*.load`, keeps each worker's newest report (a worker
silent past --worker-timeout is gone), and every --interval asks policy.py's `Planner`
how many prefill and decode workers to run. A changed decision goes to the actuator
(actuators.py); every decision is logged. It runs apart from the routers: a router's
restart does not restart it, and its own restart loses only the hysteresis' clock.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.msg import Msg

from libs.common.log import get_logger
from libs.common.messages.control import LoadReport, MessageError
from libs.common.service import BaseService
from services.planner import actuators
from services.planner.config import PlannerConfig
from services.planner.policy import ROLES, Hysteresis, Planner

log = get_logger(__name__)


class PlannerService(BaseService):
    description = "Tandem planner: sizes prefill and decode from queue time and SLOs"

    def __init__(self, config: PlannerConfig):
        super().__init__(config)
        self.config: PlannerConfig = config
        self.planner = Planner(config.capacity, config.targets,
                               Hysteresis(config.scale_down_after))  # fmt: skip
        self.actuator = actuators.make(config)
        self.reports: dict[str, tuple[float, LoadReport]] = {}  # worker -> (heard, report)
        self.counts: dict[str, int] | None = None  # the last decision
        self.decisions = 0
        self._loop: asyncio.Task | None = None

    def details(self) -> dict[str, Any]:
        counts = self.counts or {}
        return {
            "actuator": self.actuator.name,
            "ttft_p90_ms": self.config.ttft_p90_ms,
            "itl_p90_ms": self.config.itl_p90_ms,
            "prefill_workers": counts.get("prefill", -1),
            "decode_workers": counts.get("decode", -1),
            "decisions": self.decisions,
            "flow_capped_by_arrivals": self.planner.decode_model_wrong_at is None,
        }

    async def on_start(self) -> None:
        await self.bus.subscribe(self.subject("workers", "*", "*", "load"), self._on_load)
        self._loop = asyncio.create_task(self._plan_loop(), name="planner")

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = LoadReport.decode(msg.data)
        except MessageError as e:
            log.warning("bad load report", subject=msg.subject, error=str(e))
            return
        self.reports[report.worker] = (time.monotonic(), report)

    def live(self, now: float) -> list[LoadReport]:
        """The newest report of each worker heard within --worker-timeout."""
        for worker in [w for w, (at, _) in self.reports.items()
                       if now - at > self.config.worker_timeout]:  # fmt: skip
            del self.reports[worker]
        return [r for _, r in self.reports.values()]

    async def _plan_loop(self) -> None:
        # First hear every worker once: a report comes every few 100 ms, a silence of
        # --worker-timeout means gone; deciding earlier would count live workers as absent.
        await asyncio.sleep(self.config.worker_timeout)
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.plan_once()
            except Exception:  # one failed decision or actuation: the next one tries again
                log.exception("planning failed")

    async def plan_once(self) -> dict[str, int]:
        now = time.monotonic()
        reports = self.live(now)
        live: dict[str, set[str]] = {role: set() for role in ROLES}
        for r in reports:
            live["decode" if r.role == "both" else r.role].add(r.worker)
        if not reports:  # NATS down or nothing runs: no evidence to scale anything by
            log.warning("no load reports: holding the counts", counts=self.counts)
            return self.counts or {}
        if self.counts is None:  # what runs now is where it starts from: no change yet
            self.counts = await self._running_now(live)
        decision = self.planner.decide(reports, self.counts, now)
        self.decisions += 1
        loads = {role: {"workers": load.workers, "waiting": load.waiting,
                        "running": load.running, "queue_time_s": round(load.queue_time_s, 3),
                        "prompt_tokens_per_s": round(load.prompt_tokens_per_s, 1)}
                 for role, load in decision.loads.items()}  # fmt: skip
        changed = decision.counts != self.counts
        peak = decision.peak_tokens_per_s
        if self.planner.decode_model_wrong_at == now and self.config.flow_window > 0:
            itl = decision.loads["decode"].itl_p90_s
            log.warning("decode ITL past the SLO: decode's flow count no longer trusts the "
                        "capacity model's arrivals peak (prefill flat out from now on); "
                        "re-measure the capacity (python -m bench.plan --measure) and "
                        "restart the planner", itl_p90_s=itl)  # fmt: skip
        log.info("planner decision", counts=decision.counts, needed=decision.needed,
                 loads=loads, changed=changed,
                 arrival_peak_tokens_per_s=None if peak is None else round(peak, 1))  # fmt: skip
        if changed or self.actuator.name == "local":  # local: also replaces exited workers
            await self.actuator.apply(decision.counts, live)
        self.counts = decision.counts
        return decision.counts

    async def _running_now(self, live: dict[str, set[str]]) -> dict[str, int]:
        """The API server's replicas (kubernetes, rbg), else the workers heard, in bounds."""
        counts = {role: len(ids) for role, ids in live.items()}
        if isinstance(self.actuator, actuators.ApiServerActuator):
            counts = await self.actuator.replicas()
        return {role: self.config.targets.clamp(role, n) for role, n in counts.items()}

    async def on_stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        await self.actuator.stop()
