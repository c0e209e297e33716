"""API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the router answers with is an `ApiError`; handlers raise it and the app's
middleware turns it (and anything unexpected, without its traceback) into a JSON body
with the right status.
"""

from __future__ import annotations

from typing import Any

# OpenAI's error `type` per status family.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An HTTP error the client should see: status, message, offending parameter.

    `headers` travel with the response (Retry-After on 429 and 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def busy(what: str, retry_after_s: int = 1) -> ApiError:
    """429 with Retry-After: a shared resource is full for now, not the request's fault."""
    return ApiError(429, what, code="busy", headers={"Retry-After": str(retry_after_s)})


def too_large(where: str, limit: int) -> ApiError:
    """The 413 for a body over `limit` bytes (declared, or found while reading)."""
    return ApiError(413, f"{where}: the request body is over this server's limit of "
                    f"{limit} bytes (--max-body-bytes)", code="request_too_large")  # fmt: skip


def no_workers(what: str = "no workers are live") -> ApiError:
    return ApiError(503, what, code="no_workers", headers={"Retry-After": "1"})
