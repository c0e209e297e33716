"""What every JSON endpoint of the router checks first: a JSON object body, the fields it
may hold, and the model it names (a 400 or a 404 in OpenAI's shape)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from services.router.errors import ApiError, bad_request
from services.router.state import RouterState


async def json_body(request: web.Request) -> Any:
    """The body as decoded JSON; a 400 when it is not JSON."""
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None


async def json_object(request: web.Request, fields: tuple[str, ...], path: str) -> dict:
    """A JSON object body with no field outside `fields` (a field we do not read is
    refused, never ignored); a 400 naming the first other one."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_request(f"'{unknown[0]}' is not a field of {path}", unknown[0])
    return body


def check_model(state: RouterState, model: Any) -> None:
    """A 404 unless `model` is this router's model name or id."""
    if model not in (state.config.model_name, state.model_id):
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{state.config.model_name}'.",
            param="model",
            code="model_not_found",
        )
