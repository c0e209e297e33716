"""Cache store flags."""

import re
from dataclasses import dataclass, field

from libs.common.config import TransferConfig
from libs.common.flags import flag_name, require_positive

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`4GiB`, `512MiB`, `64k`, `1048576` -> bytes (K/M/G/T are powers of 1024)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"expected bytes like 1048576, 64MiB or 4GiB, got {text!r}")
    power = "kmgt".find(match.group(2).lower()) + 1 if match.group(2) else 0
    return int(match.group(1)) << (10 * power)


@dataclass
class CacheStoreConfig(TransferConfig):
    """A cache store: one node of the KV pool, holding a registered memory segment."""

    SERVICE = "cache_store"

    segment_size: str = field(
        default="1GiB",
        metadata={"help": "bytes of the memory segment this store contributes (e.g. 4GiB)"},
    )
    segment_file: str = field(
        default="",
        metadata={
            "help": "back the segment with this file (shared mapping) so a restart keeps its "
            "contents; its index is kept next to it in PATH.index.json"
        },
    )
    heartbeat_interval: float = field(
        default=1.0, metadata={"help": "seconds between heartbeats to the cache master"}
    )
    ssd_dir: str = field(
        default="",
        metadata={
            "help": "an SSD tier under the segment: objects the master evicts from DRAM are "
            "kept as files here and promoted back on a get; re-indexed and checksummed at "
            "start (empty: no SSD tier)"
        },
    )
    ssd_size: str = field(
        default="16GiB",
        metadata={"help": "bytes of objects the SSD tier may hold (its oldest files go first)"},
    )
    ssd_retry_interval: float = field(
        default=30.0,
        metadata={
            "help": "seconds the SSD tier stays DRAM-only after a write failed (disk full, "
            "read-only), before it tries the disk again"
        },
    )

    @property
    def segment_bytes(self) -> int:
        return parse_size(self.segment_size)

    @property
    def ssd_bytes(self) -> int:
        return parse_size(self.ssd_size) if self.ssd_dir else 0

    def validate(self) -> None:
        super().validate()
        try:
            size = self.segment_bytes
        except ValueError as e:
            raise ValueError(f"{flag_name('segment_size')}: {e}") from None
        if size < 4096:
            raise ValueError(f"{flag_name('segment_size')}: must be >= 4096 bytes, got {size}")
        require_positive(self, "heartbeat_interval")
        require_positive(self, "ssd_retry_interval")
        try:
            ssd = parse_size(self.ssd_size)
        except ValueError as e:
            raise ValueError(f"{flag_name('ssd_size')}: {e}") from None
        if self.ssd_dir and ssd < 4096:
            raise ValueError(f"{flag_name('ssd_size')}: must be >= 4096 bytes, got {ssd}")
        if self.segment_file and self.transport == "shm":
            raise ValueError(
                f"{flag_name('segment_file')}: the shm transport serves only its own shared "
                "memory; use --transport tcp (or rdma) with a segment file"
            )
