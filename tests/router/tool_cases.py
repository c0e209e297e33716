"""The tools and tool-call blocks that test_tool_request.py and test_tool_parse.py share."""

from __future__ import annotations

import json

from services.router.structured.tools.request import Tool, ToolRequest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}


def tool_request(
    choice: str = "auto", function: str | None = None, parallel: bool = True
) -> ToolRequest:
    return ToolRequest(
        (Tool("get_weather", "w", WEATHER), Tool("get_time", "t", TIME)), choice, function, parallel
    )


def call_block(name: str, arguments) -> str:
    """One call in the Hermes format the forcing grammar asks for."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
