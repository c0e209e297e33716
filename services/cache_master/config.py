"""Cache master flags."""

from dataclasses import dataclass, field

from libs.common.config import CommonConfig, require_positive


@dataclass
class CacheMasterConfig(CommonConfig):
    """The cache master: metadata of the KV pool (segments, objects, replicas, leases)."""

    SERVICE = "cache_master"

    heartbeat_timeout: float = field(
        default=10.0, metadata={"help": "seconds of store silence before its replicas are dropped"}
    )
    lease_ttl: float = field(default=10.0, metadata={"help": "seconds a read lease lasts"})

    def validate(self) -> None:
        super().validate()
        require_positive(self, "heartbeat_timeout")
        require_positive(self, "lease_ttl")
