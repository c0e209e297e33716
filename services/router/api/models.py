"""GET /v1/models, GET /v1/models/{id} (the openai client's models.retrieve) and
GET /version: what this router serves."""

from __future__ import annotations

from aiohttp import web

from libs.common import __version__
from services.router.formats.bodies import check_model
from services.router.formats.openai import shapes as fmt
from services.router.state import STATE


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        fmt.models_body(state.config.model_name, state.created, state.context_len())
    )


async def retrieve_model(request: web.Request) -> web.Response:
    """The served model's card; another id is a 404 `model_not_found` (bodies.py)."""
    state = request.app[STATE]
    check_model(state, request.match_info["model_id"])
    body = fmt.models_body(state.config.model_name, state.created, state.context_len())
    return web.json_response(body["data"][0])


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})
