"""What a worker's load reports say about it, counted as its roles serve.

`WorkerLoad` keeps the counts (prompt tokens accepted and still queued, output tokens since
the last report) and the latency windows (latency.py: TTFT and ITL as this worker saw
them), and makes the `LoadReport` that WorkerCore publishes every `load_interval` on
`<prefix>.workers.<role>.<id>.load`: what the router routes by and the planner plans from
(docs/protocol.md, docs/operations.md).
"""

from __future__ import annotations

import secrets
import time

from libs.common.config import WorkerConfig
from libs.common.engine.step_loop import EngineCore
from libs.common.messages.control import LoadReport
from libs.common.worker.latency import LatencyWindow


class WorkerLoad:
    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config, self.role = config, role
        self.instance = secrets.token_hex(8)  # this process, in its load reports
        self.queued_prompt_tokens = 0  # accepted, not yet prefilled (for routing)
        self._prompt_tokens_in = 0  # prompt tokens accepted since the last report
        self._tokens_out = 0  # output tokens since the last report
        self.ttft, self.itl = LatencyWindow(), LatencyWindow()

    def prompt_accepted(self, tokens: int) -> None:
        """A prompt of `tokens` is queued here (until `prompt_started`)."""
        self.queued_prompt_tokens += tokens
        self._prompt_tokens_in += tokens

    def prompt_started(self, tokens: int) -> None:
        """A prompt `prompt_accepted` counted is no longer waiting (computed or gone)."""
        self.queued_prompt_tokens -= tokens

    def count_output_tokens(self, n: int) -> None:
        self._tokens_out += n

    def report(
        self, core: EngineCore, model_id: str, kv_dtype: str, max_model_len: int, interval: float
    ) -> LoadReport:
        """The load now, rates over the last `interval` seconds (whose counts restart)."""
        scheduler = core.scheduler
        report = LoadReport(
            worker=self.config.service_id,
            role=self.role,
            model_id=model_id,
            page_size=self.config.page_size,
            kv_dtype=kv_dtype,
            waiting=scheduler.num_waiting,
            running=scheduler.num_running,
            waiting_prefill_tokens=self.queued_prompt_tokens,
            free_pages=scheduler.num_free_pages,
            total_pages=core.kv_cache.num_pages,
            tokens_per_s=self._tokens_out / interval,
            max_model_len=max_model_len,
            timestamp=time.time(),
            instance=self.instance,
            max_running=self.config.max_num_seqs,
            queue_time_s=scheduler.oldest_wait(time.monotonic()),
            prompt_tokens_per_s=self._prompt_tokens_in / interval,
            ttft_p90_s=self.ttft.quantile(0.9),
            itl_p90_s=self.itl.quantile(0.9),
        )
        self._tokens_out = self._prompt_tokens_in = 0
        return report
