"""The Responses API's response object, its output items and usage, in the shapes the
`openai` client parses (`Response`, `ResponseOutputMessage`, `ResponseFunctionToolCall`).

Pure functions of what the router collected: the text outside tool-call blocks becomes
one assistant `message` item with one `output_text` part, each tool call a `function_call`
item. Usage: input tokens as tokenized here, cached ones as the workers reported them,
output tokens as streamed.
"""

from __future__ import annotations

import uuid
from typing import Any

from services.router.formats.openai.shapes import Totals
from services.router.formats.responses.request import ResponsesRequest


def new_id(prefix: str) -> str:
    """`resp_`, `msg_`, `fc_` + 32 hex: unguessable, so an id is also a capability."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A text part; `logprobs`: chat's per-token entries (token, logprob, bytes,
    top_logprobs), the Responses shape too."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A function_call item from a chat tool-call delta ({id, function: {name, arguments}});
    in progress its arguments are still empty."""
    function = call["function"]
    arguments = function["arguments"] if status != "in_progress" else ""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": arguments}  # fmt: skip


def usage(totals: Totals) -> dict[str, Any]:
    return {
        "input_tokens": totals.prompt_tokens,
        "input_tokens_details": {"cached_tokens": totals.cached_tokens},
        "output_tokens": totals.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": totals.prompt_tokens + totals.completion_tokens,
    }


def response_body(
    response_id: str, created: int, req: ResponsesRequest, output: list[dict[str, Any]],
    status: str,
) -> dict[str, Any]:  # fmt: skip
    """The response object; `status` in_progress (no usage yet), completed or incomplete
    (cut by max_output_tokens)."""
    v = req.fields
    fmt = (v["text"] or {}).get("format") or {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": v["instructions"],
        "max_output_tokens": v["max_output_tokens"],
        "model": v["model"],
        "output": output,
        "parallel_tool_calls": v["parallel_tool_calls"] is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": v["temperature"],
        "text": {"format": fmt},
        "tool_choice": v["tool_choice"] or "auto",
        "tools": v["tools"] or [],
        "top_p": v["top_p"],
        "top_logprobs": v["top_logprobs"],
        "truncation": "disabled",
        "usage": None,
        "user": v["user"],
        "metadata": v["metadata"] or {},
    }


def input_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input (chat messages, request.py's `input_messages`) as the Responses
    items GET /v1/responses/{id}/input_items lists, each with a new id."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"id": new_id("fco"), "type": "function_call_output",
                          "call_id": m["tool_call_id"], "output": m["content"],
                          "status": "completed"})  # fmt: skip
            continue
        if m["content"] or not m.get("tool_calls"):
            part = "output_text" if m["role"] == "assistant" else "input_text"
            items.append({"id": new_id("msg"), "type": "message", "role": m["role"],
                          "status": "completed",
                          "content": [{"type": part, "text": m["content"]}]})  # fmt: skip
        for call in m.get("tool_calls", []):
            items.append(call_item(new_id("fc"), call, "completed"))
    return items


def chat_output(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a next response continues from: one
    assistant message with its text and tool calls."""
    text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function",
         "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output if i["type"] == "function_call"
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
