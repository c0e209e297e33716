"""/v1/pins: soft pins of prefixes in the KV pool (docs/pool.md, "Soft pinning").

    POST   /v1/pins        {"prompt": "<text>"} or {"messages": [...]}, "ttl_s", "label",
                           "cache_salt" (the salt the requests that reuse the prefix send)
                           -> {"object": "pin", "id", "pages", "present", "held", ...}
    GET    /v1/pins        -> {"object": "list", "data": [pin...], "held_bytes", "budget_bytes"}
    DELETE /v1/pins/{id}   -> {"object": "pin.deleted", "id", "deleted": true}

The prefix is tokenized as a completion's prompt would be (text) or rendered through the
chat template as /v1/chat/completions renders messages (without the generation prompt, by
default: a system prompt pinned alone is the start of every chat that begins with it).
Its page keys are computed here (libs/common/engine/core/kv_hash.py) with the (model id,
KV dtype, page size) of each live worker of this model, so they are the keys under which
those workers put the prefix's pages into the pool; only full pages have keys. With a
`cache_salt` the keys are that salt's (kv_hash.chain_root): a pin holds the pages of the
requests that send the same salt, and no others. The cache master keeps the pin
(services/cache_master/pins/endpoints.py): its refusals come back with their status (400
bad TTL, 409 over --max-pins or --max-pinned-fraction, 404 unknown id), and a master that
cannot be reached is a 503.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from aiohttp import web

from libs.common.bus.connection import BusError, RemoteError
from libs.common.engine.core.kv_hash import PageHasher
from libs.common.engine.core.sampling_params import (
    MAX_CACHE_SALT_CHARS,
    SamplingError,
    check_cache_salt,
)
from libs.common.messages.pins import (
    MAX_PIN_KEYS,
    MAX_PIN_LABEL,
    PoolPin,
    PoolPinInfo,
    PoolPinList,
    PoolPinRef,
)
from services.router.admission.request import light, tenant
from services.router.admission.tenants import cache_salt
from services.router.api.openapi_parts import json_response, ref
from services.router.errors import ApiError, bad_request, no_workers
from services.router.formats.bodies import check_model, json_object
from services.router.formats.openai.chat_template import TemplateArgs
from services.router.formats.openai.messages import parse_messages
from services.router.requests.prompts import PromptTooLong, encode, render_chat
from services.router.state import STATE, RouterState

FIELDS = ("model", "prompt", "messages", "add_generation_prompt", "ttl_s", "label", "cache_salt")
PIN_ID = re.compile(r"^[0-9a-f]{16}$")
MASTER_TIMEOUT = 5.0


async def create_pin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request)
    ttl = body.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise bad_request("'ttl_s' must be a number of seconds > 0", "ttl_s")
    label, owner = body.get("label", ""), _owner(request)
    most = MAX_PIN_LABEL - len(owner)
    if not isinstance(label, str) or len(label) > most:
        raise bad_request(f"'label' must be a string of at most {most} chars", "label")
    salt = ""
    if body.get("cache_salt") is not None:
        try:
            salt = check_cache_salt("cache_salt", body["cache_salt"])
        except SamplingError as e:
            raise bad_request(str(e), "cache_salt") from None
    salt = cache_salt(tenant(request), salt)  # the tenant's pages (admission/tenants.py)
    async with light(request, body.get("prompt", body.get("messages"))):
        token_ids = await asyncio.to_thread(_tokens, state, body)
    keys = page_keys(state, token_ids, salt)
    if not keys:
        raise bad_request(f"the prefix has {len(token_ids)} tokens: fewer than a page, so "
                          "nothing of it is stored in the pool", _source(body))  # fmt: skip
    if len(keys) > MAX_PIN_KEYS:
        raise bad_request(f"the prefix has {len(keys)} pages; at most {MAX_PIN_KEYS}",
                          _source(body))  # fmt: skip
    pin = PoolPin(keys, float(ttl), owner + label, len(token_ids))
    async with light(request, None):
        info = await _ask(state, "pin", pin, PoolPinInfo)
    return web.json_response(pin_body(info, owner))


async def list_pins(request: web.Request) -> web.Response:
    owner = _owner(request)
    async with light(request, None):
        listed = await _ask(request.app[STATE], "pins", PoolPinList(), PoolPinList)
    mine = [pin_body(p, owner) for p in listed.pins if p.label.startswith(owner)]
    return web.json_response({"object": "list", "data": mine,
                              "held_bytes": listed.held_bytes,
                              "budget_bytes": listed.budget_bytes})  # fmt: skip


async def delete_pin(request: web.Request) -> web.Response:
    pin_id = request.match_info["pin_id"]
    if not PIN_ID.match(pin_id):
        raise ApiError(404, f"no pin {pin_id[:80]!r}", param="pin_id", code="pin_not_found")
    owner, state = _owner(request), request.app[STATE]
    async with light(request, None):
        if owner:  # another tenant's pin is as unknown as no pin
            listed = await _ask(state, "pins", PoolPinList(), PoolPinList)
            if not any(p.pin_id == pin_id and p.label.startswith(owner) for p in listed.pins):
                raise ApiError(404, f"no pin {pin_id!r}", param="pin_id", code="pin_not_found")
        info = await _ask(state, "unpin", PoolPinRef(pin_id), PoolPinInfo)
    return web.json_response({"object": "pin.deleted", "id": info.pin_id, "deleted": True})


def _owner(request: web.Request) -> str:
    """The prefix of the pins' labels of the request's tenant: tenants of a .toml keys file
    see and delete only their own pins; without one, every pin is everyone's."""
    who = tenant(request)
    return f"{who.name}/" if who.cache_scope else ""


def pin_body(info: PoolPinInfo, owner: str = "") -> dict[str, Any]:
    label = info.label.removeprefix(owner)
    return {"object": "pin", "id": info.pin_id, "label": label, "tokens": info.tokens,
            "pages": info.pages, "present": info.present, "held": info.held,
            "bytes": info.bytes, "expires_at": info.expires_at,
            "created_at": info.created_at}  # fmt: skip


def page_keys(state: RouterState, token_ids: list[int], cache_salt: str = "") -> list[str]:
    """The prefix's page keys, chained from `cache_salt`, for every (KV dtype, page size)
    the live workers of this model use (one, in a uniform cluster); a 503 when none is
    live."""
    salts = {(state.model_id, w.report.kv_dtype, w.report.page_size)
             for w in state.workers.live("prefill", "decode", "both")
             if w.report.model_id == state.model_id}  # fmt: skip
    if not salts:
        raise no_workers("no live worker of this model: its page keys are not known")
    keys: list[str] = []
    for salt in sorted(salts):
        keys += PageHasher(*salt).keys(token_ids, cache_salt=cache_salt)
    return keys


async def _body(request: web.Request) -> dict[str, Any]:
    body = await json_object(request, FIELDS, "/v1/pins")
    if body.get("model") is not None:
        check_model(request.app[STATE], body["model"])
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give the prefix as exactly one of 'prompt' or 'messages'", "prompt")
    if "add_generation_prompt" in body and "messages" not in body:
        raise bad_request("'add_generation_prompt' goes with 'messages'", "add_generation_prompt")
    return body


def _tokens(state: RouterState, body: dict[str, Any]) -> list[int]:
    """The prefix's token ids, as a completion or a chat completion would make them."""
    if "prompt" in body:
        text = body["prompt"]
        if not isinstance(text, str) or not text:
            raise bad_request("'prompt' must be a non-empty string", "prompt")
    else:
        messages = parse_messages(body["messages"])
        generation = body.get("add_generation_prompt", False)
        if not isinstance(generation, bool):
            raise bad_request("'add_generation_prompt' must be a boolean",
                              "add_generation_prompt")  # fmt: skip
        text = render_chat(state.tokenizer, messages, None, TemplateArgs(generation))
    limit = state.context_len()
    try:
        return encode(state.tokenizer, text, limit)
    except PromptTooLong as e:
        raise bad_request(f"the prefix has {e.num_tokens} tokens; this model's context is "
                          f"{limit}", _source(body)) from None  # fmt: skip


def _source(body: dict[str, Any]) -> str:
    return "prompt" if "prompt" in body else "messages"


async def _ask(state: RouterState, call: str, message: Any, reply_type: type) -> Any:
    subject = f"{state.config.subject_prefix}.pool.master.{call}"
    try:
        return await state.bus.request(subject, message, reply_type, timeout=MASTER_TIMEOUT)
    except RemoteError as e:
        codes = {400: ("invalid_value", "ttl_s"), 404: ("pin_not_found", "pin_id"),
                 409: ("pin_limit", None)}  # fmt: skip
        code, param = codes.get(e.code, ("pool_unavailable", None))
        status = e.code if e.code in codes else 503
        raise ApiError(
            status,
            e.message,
            param=param,
            code=code,
            headers={"Retry-After": "1"} if status == 503 else None,
        ) from None
    except BusError as e:
        raise ApiError(503, f"the pool's master is unreachable ({e})", code="pool_unavailable",
                       headers={"Retry-After": "1"}) from None  # fmt: skip


# --- /openapi.json (services/router/api/openapi.py adds these) ----------------------------------

_INT, _NUM, _STR = {"type": "integer"}, {"type": "number"}, {"type": "string"}


def _errors(*pairs: tuple[int, str]) -> dict[str, Any]:
    return {str(code): json_response("Error", text) for code, text in pairs}


_UNAUTHORIZED = (401, "missing or wrong API key (when the router has keys)")
_UNAVAILABLE = (503, "no live worker of the model, or the pool's master unreachable")
PATHS: dict[str, Any] = {
    "/v1/pins": {
        "post": {
            "summary": "Pin a prefix's pages in the KV pool for ttl_s seconds",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("PinRequest")}},
            },
            "responses": {
                "200": json_response("Pin", "the pin (a renewal when the same prefix is pinned)"),
                **_errors(
                    (400, "malformed request, TTL out of bounds, prefix under a page"),
                    _UNAUTHORIZED,
                    (404, "unknown model"),
                    (409, "over --max-pins or --max-pinned-fraction"),
                    _UNAVAILABLE,
                ),
            },
        },
        "get": {
            "summary": "Live pins",
            "responses": {
                "200": json_response("PinList", "every live pin"),
                **_errors(_UNAUTHORIZED, _UNAVAILABLE),
            },
        },
    },
    "/v1/pins/{pin_id}": {
        "delete": {
            "summary": "Unpin",
            "parameters": [{"name": "pin_id", "in": "path", "required": True, "schema": _STR}],
            "responses": {
                "200": json_response("PinDeleted", "unpinned"),
                **_errors(_UNAUTHORIZED, (404, "no such pin"), _UNAVAILABLE),
            },
        },
    },
}
_PIN = {
    "type": "object",
    "required": ["object", "id", "pages", "present", "held", "bytes", "expires_at"],
    "properties": {"object": {"const": "pin"}, "id": _STR, "label": _STR, "tokens": _INT,
                   "pages": _INT, "present": _INT, "held": _INT, "bytes": _INT,
                   "expires_at": _NUM, "created_at": _NUM},
}  # fmt: skip
SCHEMAS: dict[str, Any] = {
    "PinRequest": {
        "type": "object",
        "required": ["ttl_s"],
        "additionalProperties": False,
        "properties": {
            "model": _STR,
            "prompt": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
            "add_generation_prompt": {"type": "boolean", "default": False},
            "ttl_s": {"type": "number", "exclusiveMinimum": 0},
            "label": {"type": "string", "maxLength": MAX_PIN_LABEL},
            "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS},
        },
    },
    "Pin": _PIN,
    "PinList": {
        "type": "object",
        "required": ["object", "data", "held_bytes", "budget_bytes"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _PIN},
            "held_bytes": _INT,
            "budget_bytes": _INT,
        },
    },
    "PinDeleted": {
        "type": "object",
        "required": ["object", "id", "deleted"],
        "properties": {"object": {"const": "pin.deleted"}, "id": _STR, "deleted": {"const": True}},
    },
}
