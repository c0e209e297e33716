"""Planner flags: SLOs, bounds, the measured capacity of one worker, the actuator."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.common.config import CommonConfig
from libs.common.flags import require_positive, require_range
from services.planner.policy import Capacity, Targets

ACTUATORS = ("dry-run", "local", "kubernetes", "rbg")


@dataclass
class PlannerConfig(CommonConfig):
    """The planner: sizes prefill and decode from the workers' load reports and SLOs."""

    SERVICE = "planner"

    ttft_p90_ms: float = field(default=2000.0, metadata={"help": "TTFT SLO (p90), ms"})
    itl_p90_ms: float = field(default=100.0, metadata={"help": "ITL SLO (p90), ms"})
    min_prefill: int = field(default=1, metadata={"help": "fewest prefill workers"})
    max_prefill: int = field(default=4, metadata={"help": "most prefill workers"})
    min_decode: int = field(default=1, metadata={"help": "fewest decode workers"})
    max_decode: int = field(default=4, metadata={"help": "most decode workers"})
    interval: float = field(default=2.0, metadata={"help": "seconds between decisions"})
    scale_down_after: float = field(
        default=60.0,
        metadata={"help": "seconds a smaller count must have been enough before one worker "
                  "of a role goes (scaling up is at once)"},
    )  # fmt: skip
    worker_timeout: float = field(
        default=3.0, metadata={"help": "a worker whose load reports stop this long is gone"}
    )
    startup: float = field(
        default=10.0,
        metadata={"help": "seconds from asking for a worker to its first request served"},
    )
    flow_window: float = field(
        default=600.0,
        metadata={"help": "seconds of arrivals whose peak (averaged over --startup) caps the "
                  "decode workers kept for what prefill hands over; until the planner has "
                  "seen this long, and with 0 always, decode is planned for prefill flat out"},
    )  # fmt: skip
    utilization: float = field(
        default=0.6, metadata={"help": "plan each prefill worker busy this fraction at most"}
    )
    prefill_tokens_per_s: float = field(
        default=500.0,
        metadata={"help": "one prefill worker's prompt tokens per second (measured: "
                  "python -m bench.plan --measure)"},
    )  # fmt: skip
    decode_step_ms: float = field(
        default=14.0, metadata={"help": "a decode step's time at batch 1, ms (measured)"}
    )
    decode_step_per_seq_ms: float = field(
        default=4.0, metadata={"help": "what each sequence in the batch adds to a step, ms"}
    )
    decode_seats: int = field(default=64, metadata={"help": "a decode worker's --max-num-seqs"})
    mean_prompt_tokens: float = field(
        default=512.0, metadata={"help": "a typical prompt's tokens (its own prefill time)"}
    )
    mean_output_tokens: float = field(
        default=128.0,
        metadata={"help": "a typical request's output tokens (how long the requests prefill "
                  "hands over stay in decode)"},
    )  # fmt: skip
    actuator: str = field(
        default="dry-run",
        metadata={"help": "dry-run (log decisions), local (start and stop worker processes "
                  "on this host), kubernetes (scale the prefill and decode Deployments), rbg "
                  "(scale the prefill and decode roles of a RoleBasedGroup)",
                  "choices": ACTUATORS},
    )  # fmt: skip
    local_credentials_dir: str = field(
        default="",
        metadata={"help": "local: where <service-id>.creds files of the workers it starts "
                  "are (make run's run/secrets); empty: the workers get none"},
    )  # fmt: skip
    k8s_namespace: str = field(default="tandem", metadata={"help": "kubernetes, rbg: namespace"})
    k8s_prefill_deployment: str = field(
        default="prefill", metadata={"help": "kubernetes: the prefill Deployment"}
    )
    k8s_decode_deployment: str = field(
        default="decode", metadata={"help": "kubernetes: the decode Deployment"}
    )
    k8s_api: str = field(
        default="",
        metadata={"help": "kubernetes, rbg: API server URL (empty: in-cluster service "
                  "account, else ~/.kube/config)"},
    )  # fmt: skip
    # The defaults are deploy/rbg/group/rolebasedgroup.yaml's (tests/deploy/test_rbg.py).
    rbg_name: str = field(default="tandem", metadata={"help": "rbg: the RoleBasedGroup"})
    rbg_prefill_role: str = field(
        default="prefill", metadata={"help": "rbg: the group's role of the prefill workers"}
    )
    rbg_decode_role: str = field(
        default="decode", metadata={"help": "rbg: the group's role of the decode workers"}
    )

    def validate(self) -> None:
        super().validate()
        for name in ("ttft_p90_ms", "itl_p90_ms", "interval", "worker_timeout", "startup",
                     "prefill_tokens_per_s", "decode_step_ms", "decode_seats",
                     "mean_prompt_tokens", "mean_output_tokens"):  # fmt: skip
            require_positive(self, name)
        require_range(self, "utilization", 0.05, 1.0)
        require_range(self, "scale_down_after", 0.0, 86400.0)
        require_range(self, "flow_window", 0.0, 86400.0)
        require_range(self, "decode_step_per_seq_ms", 0.0, 10_000.0)
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 0 <= low <= high or high < 1:
                raise ValueError(f"--min-{role}/--max-{role}: need 0 <= min <= max, max >= 1, "
                                 f"got {low}, {high}")  # fmt: skip
        if self.actuator == "rbg" and self.rbg_prefill_role == self.rbg_decode_role:
            raise ValueError(f"--rbg-prefill-role/--rbg-decode-role: need two roles, got "
                             f"{self.rbg_prefill_role!r} for both")  # fmt: skip

    @property
    def targets(self) -> Targets:
        return Targets(
            ttft_s=self.ttft_p90_ms / 1000,
            itl_s=self.itl_p90_ms / 1000,
            min_workers={"prefill": self.min_prefill, "decode": self.min_decode},
            max_workers={"prefill": self.max_prefill, "decode": self.max_decode},
            utilization=self.utilization,
            mean_prompt_tokens=self.mean_prompt_tokens,
            mean_output_tokens=self.mean_output_tokens,
            startup_s=self.startup,
            flow_window_s=self.flow_window,
        )

    @property
    def capacity(self) -> Capacity:
        return Capacity(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_step_base_s=self.decode_step_ms / 1000,
            decode_step_per_seq_s=self.decode_step_per_seq_ms / 1000,
            decode_seats=self.decode_seats,
        )
