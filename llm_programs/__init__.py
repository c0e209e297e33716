"""A small language for LLM programs, run against a Tandem router over HTTP (README.md)."""

from llm_programs.calls import Gen, Select, Usage, gen, select
from llm_programs.errors import CallError, CallTimeout, ProgramError, ProgramInputError
from llm_programs.program import Program, Streamed, function
from llm_programs.router import Router
from llm_programs.state import CallRecord, ChoiceScore, Piece, State

__all__ = [
    "CallError",
    "CallRecord",
    "CallTimeout",
    "ChoiceScore",
    "Gen",
    "Piece",
    "Program",
    "ProgramError",
    "ProgramInputError",
    "Router",
    "Select",
    "State",
    "Streamed",
    "Usage",
    "function",
    "gen",
    "select",
]
