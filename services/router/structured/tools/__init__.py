"""Tool calling: a request's tools and tool_choice -> the template's tools or the fallback
prompt and the forcing grammar (request.py); tool calls read back out of the output,
whole or streamed (parse.py)."""
