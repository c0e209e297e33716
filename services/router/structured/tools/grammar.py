"""The grammar that forces tool calls, and every tool's schema checked in the grammar pool.

    grammar = tool_grammar(req)                            # "required" / a named function
    forced = await check_tool_grammar(req, pool, limits)   # off the loop; 400 when refused

The calls' format (OPEN, CLOSE, one JSON object of name and arguments) is request.py's.
"""

from __future__ import annotations

import asyncio
import json

from libs.common.engine.core.sampling_params import MAX_GRAMMAR_CHARS
from libs.common.grammar import build
from libs.common.grammar.pool import GrammarPool, GrammarPoolBusy, GrammarRefused
from services.router.errors import bad_request, busy
from services.router.structured.limits import GrammarLimits
from services.router.structured.tools.request import CLOSE, OPEN, ToolRequest

# Forced parallel calls per answer, at most: a small model at temperature 1 would otherwise
# go on calling until max_tokens (docs/structured_output.md).
MAX_PARALLEL_CALLS = 8


def tool_grammar(req: ToolRequest) -> str | None:
    """A grammar (llguidance's format) that forces tool calls: one call of the named
    function for "function"; for "required" one call of any tool, or with parallel calls
    1 to MAX_PARALLEL_CALLS separated by "\\n". None for "auto" and "none"."""
    if req.choice == "required":
        tools = req.tools
    elif req.choice == "function":
        tools = tuple(t for t in req.tools if t.name == req.function)
    else:
        return None
    more = req.parallel and req.choice == "required"
    rules = ["start: call" + (f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if more else "")]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = json.dumps(f'{OPEN}\n{{"name": "{tool.name}", "arguments": ')
        rules.append(f"call_{i}: {head} args_{i} {json.dumps('}' + chr(10) + CLOSE)}")
        rules.append(f"args_{i}: {build.json_rule(tool.parameters)}")
    return build.lark("\n".join(rules) + "\n")


async def check_tool_grammar(
    req: ToolRequest, pool: GrammarPool, limits: GrammarLimits
) -> str | None:
    """Compile every tool's parameters schema and the forcing grammar (or find them
    compiled), in the grammar pool; the forcing grammar's text (None when not forced). A
    400 naming "tools" when a schema is over --tool-schema-max-chars or one cannot be
    enforced (or not in time)."""
    items, forced, key = await asyncio.to_thread(_items, req, limits)
    try:
        await pool.run(key, "tools", items)
    except GrammarRefused as e:
        index = e.index if e.index is not None and e.index < len(req.tools) else None
        message = str(e) if index is None else f"'tools[{index}].function.parameters': {e}"
        if "'tools" not in message:
            message = f"'tools': {message}"
        raise bad_request(message, "tools") from None
    except GrammarPoolBusy as e:
        raise busy(f"the grammar checker is busy ({e}); try again") from None
    return forced


def _items(
    req: ToolRequest, limits: GrammarLimits
) -> tuple[list[tuple[str, str]], str | None, str]:
    """The pool's items for `req`: each tool's schema (within the limit), then the forcing
    grammar when there is one; that grammar; their key (in a thread: O(the tools))."""
    items = [("json", limits.tool_schema(i, t.parameters)) for i, t in enumerate(req.tools)]
    forced = tool_grammar(req)
    if forced is not None:
        if len(forced) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"'tools' is over {MAX_GRAMMAR_CHARS} characters as a grammar",
                              "tools")  # fmt: skip
        items.append(("grammar", forced))
    return items, forced, GrammarPool.key(items)
