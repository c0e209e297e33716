"""Cache master flags."""

from dataclasses import dataclass, field

from libs.common.config import CommonConfig
from libs.common.flags import flag_name, require_positive, require_range


@dataclass
class CacheMasterConfig(CommonConfig):
    """The cache master: metadata of the KV pool (segments, objects, replicas, leases)."""

    SERVICE = "cache_master"

    heartbeat_timeout: float = field(
        default=10.0, metadata={"help": "seconds of store silence before its replicas are dropped"}
    )
    lease_ttl: float = field(default=10.0, metadata={"help": "seconds a read lease lasts"})
    replicas: int = field(
        default=1, metadata={"help": "copies of each object, on distinct stores (when there)"}
    )
    max_object_size: int = field(
        default=64 << 20, metadata={"help": "largest object a put may store, bytes"}
    )
    put_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds a put may stay unfinished before its ranges are reclaimed"},
    )
    high_watermark: float = field(
        default=0.9, metadata={"help": "segment use (0-1) at which LRU eviction starts"}
    )
    low_watermark: float = field(
        default=0.8, metadata={"help": "segment use (0-1) eviction brings a segment down to"}
    )
    min_object_size: int = field(
        default=64, metadata={"help": "smallest object a put may store, bytes (metadata bound)"}
    )
    max_pending_puts: int = field(
        default=8192,
        metadata={"help": "objects one client may have reserved and not yet put_end'ed"},
    )
    max_lease_pin: float = field(
        default=120.0,
        metadata={"help": "longest unbroken read lease of one object, seconds (>= --lease-ttl)"},
    )
    mount_timeout: float = field(
        default=30.0, metadata={"help": "seconds an idle, unfinished store mount is kept"}
    )
    epoch: int = field(
        default=0,
        metadata={
            "help": "this master's epoch (0: from the clock or the election); a higher one "
            "fences it. Set: this master serves at once with it, without an election"
        },
    )
    election: bool = field(
        default=True,
        metadata={
            "help": "elect one leader among the masters through JetStream KV; the others "
            "stand by (false: serve at once, one master only)"
        },
    )
    election_lease: float = field(
        default=2.5,
        metadata={
            "help": "seconds a leader's claim lasts from its last acknowledged renewal "
            "(renewed every tenth of it): a JetStream outage shorter than that leaves the "
            "leader leading; past it the leader steps down and a standby may take over"
        },
    )
    election_bucket_bytes: int = field(
        default=64 << 20,
        metadata={
            "help": "bytes the masters' JetStream bucket (leader key, saved pins) may hold, "
            "set when a master creates it; each value at most 1 MiB (>= 1 MiB)"
        },
    )
    ssd_spill_watermark: float = field(
        default=0.5,
        metadata={
            "help": "stores with an SSD tier: above this use of a DRAM segment, its coldest "
            "objects (what lies above it) are copied to SSD ahead of eviction"
        },
    )
    max_pinned_fraction: float = field(
        default=0.25,
        metadata={
            "help": "soft pins hold at most this fraction (0-1, below --low-watermark) of "
            "each segment out of eviction; a pin that would need more is refused"
        },
    )
    max_pins: int = field(default=64, metadata={"help": "live soft pins at most"})
    max_pin_ttl: float = field(
        default=7 * 24 * 3600.0, metadata={"help": "longest TTL of a soft pin, seconds"}
    )
    sweep_interval: float = field(
        default=0.5,
        metadata={"help": "seconds between sweeps (dead stores, stale puts, ended leases)"},
    )

    @property
    def elected(self) -> bool:
        """Whether this master waits to win the election (an imposed --epoch does not)."""
        return self.election and self.epoch == 0

    def validate(self) -> None:
        super().validate()
        for name in ("heartbeat_timeout", "lease_ttl", "replicas", "max_object_size"):
            require_positive(self, name)
        for name in ("put_timeout", "sweep_interval", "min_object_size", "max_pending_puts"):
            require_positive(self, name)
        for name in ("max_lease_pin", "mount_timeout", "election_lease", "max_pins"):
            require_positive(self, name)
        if self.election_bucket_bytes < 1 << 20:
            raise ValueError(f"{flag_name('election_bucket_bytes')}: must be >= 1048576 (one "
                             f"value's bound), got {self.election_bucket_bytes}")  # fmt: skip
        if self.epoch < 0:
            raise ValueError(f"{flag_name('epoch')}: must be >= 0, got {self.epoch}")
        if self.min_object_size > self.max_object_size:
            raise ValueError(
                f"{flag_name('min_object_size')}: must be <= --max-object-size "
                f"({self.max_object_size}), got {self.min_object_size}"
            )
        if self.max_lease_pin < self.lease_ttl:
            raise ValueError(
                f"{flag_name('max_lease_pin')}: must be >= --lease-ttl ({self.lease_ttl}), "
                f"got {self.max_lease_pin}"
            )
        require_range(self, "high_watermark", 0.01, 1.0)
        require_range(self, "low_watermark", 0.0, 1.0)
        require_range(self, "ssd_spill_watermark", 0.0, 1.0)
        require_positive(self, "max_pin_ttl")
        if not 0.0 <= self.max_pinned_fraction < self.low_watermark:
            raise ValueError(
                f"{flag_name('max_pinned_fraction')}: must be in [0, --low-watermark "
                f"({self.low_watermark})), got {self.max_pinned_fraction}"
            )
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"{flag_name('low_watermark')}: must be below --high-watermark "
                f"({self.high_watermark}), got {self.low_watermark}"
            )
