"""The exceptions a program raises. Each names the call that failed (`gen('answer')`,
`select('verdict')`, `render`), prefixed by the program's name, so a failure in a batch of
programs points at one line of one program."""

from __future__ import annotations


class ProgramError(Exception):
    """Base of every error this package raises on purpose."""


class ProgramInputError(ProgramError, ValueError):
    """A call was written wrong (a select with no choices, a name set twice, a gen outside
    an assistant turn in a chat): raised before anything is sent."""


class CallError(ProgramError):
    """The router refused or failed a call. `status` is the HTTP status, None when no
    answer came (a closed port, a dropped connection)."""

    def __init__(self, call: str, message: str, status: int | None = None):
        super().__init__(f"{call}: {message}")
        self.call, self.status = call, status


class CallTimeout(CallError, TimeoutError):
    """A call took longer than the router client's `timeout`: it was abandoned (the
    request's connection is closed, which cancels it on the router)."""
