"""Stored responses (POST /v1/responses with `store`), kept in a JetStream KV bucket so a
conversation continues through any router and after a router restart.

The bucket (`responses_bucket(prefix)`, libs/common/bus/permissions.py; file storage, one
history entry per key) holds one `StoredResponse` (libs/common/messages/responses.py) per
key `resp_<32 hex>`. Every router opens it (creating it when missing: routers creating it
with one config both succeed) on first use. Its bounds are the router flags:

- `--responses-ttl`: the bucket's max age; a response older than that is gone (GET 404,
  previous_response_id 400);
- `--responses-max-mb`: the bucket's size; when it is full a new response is not stored
  (its body says `"store": false`) until old ones expire. One response must also fit in one
  NATS message (the connection's max payload, 1 MiB by default).

A bucket made earlier keeps the bounds it was made with (JetStream does not change them
here); docs/configuration.md says how to change them.
"""

from __future__ import annotations

from typing import Any

from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from libs.common.bus.connection import Bus
from libs.common.bus.permissions import responses_bucket
from libs.common.log import get_logger
from libs.common.messages.responses import StoredResponse
from libs.common.messages.schema import MessageError
from services.router.config import RouterConfig
from services.router.errors import ApiError

log = get_logger(__name__)


class ResponseStore:
    """Reads and writes stored responses; a JetStream failure on a read is a 503."""

    def __init__(self, bus: Bus, config: RouterConfig):
        self.bus, self.bucket = bus, responses_bucket(config.subject_prefix)
        self.ttl, self.max_bytes = config.responses_ttl, config.responses_max_mb << 20
        self.timeout = config.request_timeout
        self._kv: Any = None

    async def _open(self) -> Any:
        if self._kv is None:
            js = self.bus.nc.jetstream(timeout=self.timeout)
            try:
                self._kv = await js.key_value(self.bucket)
            except BucketNotFoundError:
                self._kv = await js.create_key_value(
                    bucket=self.bucket, history=1, ttl=self.ttl, max_bytes=self.max_bytes,
                    storage=StorageType.FILE, description="Tandem stored responses",
                )  # fmt: skip
        return self._kv

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, deleted, expired)."""
        try:
            entry = await (await self._open()).get(response_id)
        except KeyNotFoundError:  # deleted ones too (KeyDeletedError is one)
            return None
        except Exception as e:
            self._kv = None  # open it again next time (JetStream restarted, bucket lost)
            raise _unavailable(e) from None
        try:
            return StoredResponse.decode(entry.value or b"")
        except MessageError as e:
            log.warning("unreadable stored response", response_id=response_id, error=str(e))
            return None

    async def put(self, record: StoredResponse) -> bool:
        """Store `record`; False (logged) when it cannot be: too big, the bucket full or
        JetStream unreachable. The response itself still goes to the client."""
        data = record.encode()
        try:
            limit = self.bus.nc.max_payload  # BusError when not connected
            if len(data) > limit:
                log.warning("response not stored: larger than a NATS message",
                            response_id=record.id, bytes=len(data), max_payload=limit)  # fmt: skip
                return False
            await (await self._open()).put(record.id, data)
        except Exception as e:
            self._kv = None
            log.warning("response not stored", response_id=record.id,
                        error=str(e) or type(e).__name__)  # fmt: skip
            return False
        return True

    async def delete(self, response_id: str) -> bool:
        """Delete a stored response; False when there is none."""
        if await self.get(response_id) is None:
            return False
        try:
            await (await self._open()).delete(response_id)
        except Exception as e:
            self._kv = None
            raise _unavailable(e) from None
        return True


def _unavailable(e: Exception) -> ApiError:
    return ApiError(
        503,
        f"stored responses are unavailable (JetStream): {e or type(e).__name__}",
        code="store_unavailable",
        headers={"Retry-After": "1"},
    )
