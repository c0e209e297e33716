"""Tool calling: a request's tools and tool_choice -> the template's tools or the fallback
prompt (request.py) and the forcing grammar, the schemas checked in the grammar pool
(grammar.py); tool calls read back out of the output, whole or streamed (parse.py)."""
