"""Stored responses of the Responses API (POST /v1/responses with `store`), as the router
saves them in its JetStream KV bucket (`responses_bucket(prefix)`,
libs/common/bus/permissions.py; services/router/requests/stored.py), so a conversation
continues through any router and after a restart:

    key resp_<32 hex>  ->  StoredResponse (this module's one message)

`messages` is the conversation through this response's output in chat form (roles
system, user, assistant with `tool_calls`, tool), the request's `instructions` left out:
a request that names it as `previous_response_id` continues from there. `body` is the
response object as the client got it, for GET /v1/responses/{id}; `input_items` this
request's input as Responses items (ids given when stored), for GET
/v1/responses/{id}/input_items. Both are plain JSON,
decoded by msgspec like every message (nothing is evaluated).
"""

from __future__ import annotations

from typing import Any

from msgspec import field

from libs.common.messages.schema import Message


class StoredResponse(Message, tag="stored_response"):
    """One stored response: its id, when it was made (unix seconds), the conversation
    that a next response continues, and the response object itself."""

    id: str
    created_at: float
    messages: list[dict[str, Any]] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)
    input_items: list[dict[str, Any]] = field(default_factory=list)
