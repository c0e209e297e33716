"""The aiohttp application: routes, request ids, API keys, errors in OpenAI's shape
(Anthropic's on /v1/messages*).

    middleware  a POST's root span, when tracing is on (libs/common/tracing.py)
                -> request id (x-request-id in and out; bound to every log line)
                -> API key check on /v1/*, /tokenize and /detokenize
                -> a declared body over --max-body-bytes: 413 before it is read
                -> handler; ApiError / HTTP errors / anything else -> an error body
Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/chat/render (a chat
request's prompt text, not run), POST /v1/responses, GET and DELETE /v1/responses/{id}
(OpenAI's Responses API, requests/responses.py), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API, requests/messages.py: its errors in
Anthropic's shape), POST/GET /v1/pins and DELETE /v1/pins/{id} (soft pins of prefixes in
the KV pool, pins.py), GET /v1/models and /v1/models/{id} (models.py), POST /tokenize and
/detokenize (tokens.py), GET /version, GET /health, GET /metrics, GET /openapi.json. No
response ever carries a traceback, and every error (an unknown path, a wrong method, a
body too large included) has the error shape. An API key comes as
`Authorization: Bearer <key>` or as `x-api-key: <key>` (Anthropic's header); it names the
request's tenant (admission/credentials.py), whose queue admits it (admission/gate.py).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from libs.common import tracing
from libs.common.log import get_logger, request_context
from services.router.admission import budget
from services.router.admission.credentials import tenant_of
from services.router.admission.gate import GATE, Gate
from services.router.admission.request import TENANT
from services.router.admission.tenants import DEFAULT, KeyRing
from services.router.api import connection_middleware, models, openapi, pins, render, tokens
from services.router.api.connections import ConnectionLimits
from services.router.errors import ApiError, too_large
from services.router.formats.anthropic import shapes as anthropic
from services.router.requests import lifecycle, messages, responses
from services.router.requests.stored import ResponseStore
from services.router.state import STATE, RouterState

log = get_logger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # must be safe inside a NATS subject
_PROTECTED = re.compile(r"^/(v1/|tokenize$|detokenize$)")  # behind the API key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


KEYS: web.AppKey[KeyRing] = web.AppKey("api_keys", KeyRing)


def build_app(state: RouterState, keys: KeyRing, gate: Gate) -> web.Application:
    # connections: the header deadline ends as a request starts; its body has a deadline.
    middlewares = [
        connection_middleware.track, _traced, _middleware, connection_middleware.read_body
    ]  # fmt: skip
    app = web.Application(middlewares=middlewares, client_max_size=state.config.max_body_bytes)
    connection_middleware.install(app, ConnectionLimits.of(state.config))
    app[STATE], app[KEYS], app[GATE] = state, keys, gate
    app[responses.STORE] = ResponseStore(state.bus, state.config)
    for method, path, handler in routes():
        # A model id may hold slashes (org/name): the route takes the rest of the path.
        app.router.add_route(method, path.replace("{model_id}", "{model_id:.+}"), handler)
    return app


def routes() -> list[tuple[str, str, Handler]]:
    """Every route of the API (the OpenAPI test compares this list with the document)."""
    return [
        ("POST", "/v1/completions", lifecycle.completions),
        ("POST", "/v1/chat/completions", lifecycle.chat_completions),
        ("POST", "/v1/chat/render", render.chat_render),
        ("POST", "/v1/responses", responses.create),
        ("GET", "/v1/responses/{response_id}", responses.retrieve),
        ("GET", "/v1/responses/{response_id}/input_items", responses.list_input_items),
        ("DELETE", "/v1/responses/{response_id}", responses.delete),
        ("POST", "/v1/messages", messages.messages),
        ("POST", "/v1/messages/count_tokens", messages.count_tokens),
        ("POST", "/v1/pins", pins.create_pin),
        ("GET", "/v1/pins", pins.list_pins),
        ("DELETE", "/v1/pins/{pin_id}", pins.delete_pin),
        ("GET", "/v1/models", models.list_models),
        ("GET", "/v1/models/{model_id}", models.retrieve_model),
        ("POST", "/tokenize", tokens.tokenize),
        ("POST", "/detokenize", tokens.detokenize),
        ("GET", "/version", models.version),
        ("GET", "/health", _health),
        ("GET", "/metrics", _metrics),
        ("GET", "/openapi.json", _openapi),
    ]


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None):
    return web.Response(
        body=orjson.dumps(body), status=status, headers=headers, content_type="application/json"
    )


@web.middleware
async def _traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The root span of a POST's trace (a `traceparent` header from the client continues
    the client's trace); the requests a GET answers are not traced."""
    if request.method != "POST" or not tracing.enabled():
        return await handler(request)
    name, context = f"POST {request.path}", tracing.joined(request.headers)
    with tracing.span(name, "", context=context, kind=tracing.SpanKind.SERVER) as span:
        response = await handler(request)
        if span is not None:
            span.set_attributes({tracing.REQUEST_ID: request.get("request_id", ""),
                                 "http.response.status_code": response.status})  # fmt: skip
        return response


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    given = request.headers.get("x-request-id", "")
    rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
    request["request_id"], request["arrived"] = rid, time.monotonic()
    state = request.app[STATE]
    with request_context(rid):
        try:
            _authorize(request)
            budget.body_size(request, state.config)
            response = await handler(request)
        except ApiError as e:
            response = _error(request, e, state)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = _error(request, _http_error(e, request), state)
        except ConnectionResetError:
            log.info("client disconnected")
            raise
        except asyncio.CancelledError:
            log.info("request cancelled (client disconnected)")
            raise
        except Exception:
            log.exception("unexpected error")
            error = ApiError(500, "internal error; see the router log")
            response = _error(request, error, state)
        if not response.prepared:
            response.headers["x-request-id"] = rid
        return response


def _error(request: web.Request, e: ApiError, state: RouterState) -> web.Response:
    """The error's response: OpenAI's body, or Anthropic's on Anthropic's paths."""
    state.metrics.failure.labels(state.metrics.model, str(e.status)).inc()
    if e.status >= 500:
        log.warning("request failed", status=e.status, error=e.message)
    is_anthropic = request.path.startswith("/v1/messages")
    body = anthropic.error_body(e) if is_anthropic else e.body()
    return _json(body, e.status, e.headers)


def _http_error(e: web.HTTPException, request: web.Request) -> ApiError:
    """aiohttp's own errors (no route, wrong method, body too large) as ApiErrors."""
    where = f"{request.method} {request.path}"
    if e.status == 413:
        return too_large(where, request.app[STATE].config.max_body_bytes)
    message = {
        404: f"{where}: no such route",
        405: f"{where}: method not allowed",
    }.get(e.status, f"{where}: {e.reason or 'error'}")
    allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
    return ApiError(e.status, message, code=str(e.status), headers=allow)


def _authorize(request: web.Request) -> None:
    """The request's tenant, from its API key on the protected paths (401 without one)."""
    keys = request.app[KEYS]
    protected = keys and _PROTECTED.match(request.path)
    request[TENANT] = tenant_of(request.headers, keys) if protected else DEFAULT


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    counts = {role: len(state.workers.live(role)) for role in ("prefill", "decode", "both")}
    nats = state.bus.connected
    ready = nats and state.workers.ready()
    body = {
        "status": "ok" if ready else "unavailable",
        "nats": nats,
        "workers": counts,
        "kv_index_keys": len(state.index),
        "kv_index_replayed": state.replayed(),
    }
    if not ready:
        body["reason"] = "NATS is unreachable" if not nats else "no prefill+decode or both worker"
    return _json(body, 200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    for w in state.workers.live("prefill", "decode", "both"):
        state.metrics.observe_worker(w)
    state.metrics.index_keys.set(len(state.index))
    gate = request.app[GATE]
    state.metrics.admission_running.set(gate.running)
    state.metrics.admission_queued.set(len(gate.queue))
    state.metrics.admission_tps.set(gate.throughput.per_s(gate.clock()))
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _openapi(request: web.Request) -> web.Response:
    return _json(openapi.document(request.app[STATE].config.model_name))
