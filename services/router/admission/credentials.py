"""The API key of a request: `Authorization: Bearer <key>` or `x-api-key: <key>`
(Anthropic's clients' header), checked before anything else of the request is read.

Any header that is not a well-formed key (other bytes than printable ASCII, control
characters, an empty bearer, another scheme, over MAX_KEY_CHARS) is the same 401 as a wrong
key: the client learns nothing from the difference, and nothing here can raise anything
else (aiohttp hands undecodable bytes over as surrogates, which are not ASCII).
"""

from __future__ import annotations

from collections.abc import Mapping

from services.router.admission.tenants import DEFAULT, KeyRing, Tenant
from services.router.errors import ApiError

MAX_KEY_CHARS = 256


def tenant_of(headers: Mapping[str, str], keys: KeyRing) -> Tenant:
    """The request's tenant: DEFAULT when no key is configured; 401 unless it presents one."""
    if not keys:
        return DEFAULT
    key = presented_key(headers)
    tenant = keys.tenant(key) if key is not None else None
    if tenant is None:
        raise unauthorized()
    return tenant


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key, or None when no header holds a well-formed one."""
    scheme, _, key = headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and _well_formed(key.strip()):
        return key.strip()
    key = headers.get("x-api-key", "").strip()  # when Authorization holds no bearer key
    return key if _well_formed(key) else None


def _well_formed(key: str) -> bool:
    return 0 < len(key) <= MAX_KEY_CHARS and key.isascii() and key.isprintable() and " " not in key


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
