"""Cache store flags."""

from dataclasses import dataclass, field

from libs.common.config import CommonConfig, require_positive


@dataclass
class CacheStoreConfig(CommonConfig):
    """A cache store: one node of the KV pool, holding a registered memory segment."""

    SERVICE = "cache_store"

    segment_size: int = field(
        default=1 << 30, metadata={"help": "bytes of the memory segment this store contributes"}
    )
    segment_file: str = field(
        default="",
        metadata={"help": "back the segment with this file so a restart keeps its contents"},
    )
    transport: str = field(
        default="auto",
        metadata={
            "help": "KV transfer transport; auto = rdma where a device exists, else tcp",
            "choices": ("auto", "rdma", "tcp", "shm"),
        },
    )

    def validate(self) -> None:
        super().validate()
        require_positive(self, "segment_size")
