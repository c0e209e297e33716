"""Structured output: response_format, regex and ebnf -> one grammar (output.py), and tool
calling (tools/). Imports only libs/ and errors.py."""
