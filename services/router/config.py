"""Router flags."""

from dataclasses import dataclass, field

from libs.common.config import CommonConfig, require_range


@dataclass
class RouterConfig(CommonConfig):
    """The router: the OpenAI-compatible HTTP API in front of the workers."""

    SERVICE = "router"

    host: str = field(default="127.0.0.1", metadata={"help": "address the HTTP API listens on"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0 picks a free one)"})

    def validate(self) -> None:
        super().validate()
        require_range(self, "port", 0, 65535)
