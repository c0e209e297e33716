"""The typed Server-Sent Events of a streamed response, in OpenAI's order:

    response.created, response.in_progress
    per message item:   response.output_item.added, response.content_part.added,
                        response.output_text.delta ..., response.output_text.done,
                        response.content_part.done, response.output_item.done
    per function call:  response.output_item.added, response.function_call_arguments.delta,
                        response.function_call_arguments.done, response.output_item.done
    response.completed (response.incomplete when cut by max_output_tokens; response.failed
    when the request failed after the stream began)

Every event has `type` and a `sequence_number` counting from 0. A tool call goes out
whole when its block closes (tools/parse.py holds it back until then), so its arguments
come in one delta. `ResponseEvents` only builds the events; the handler writes them
(services/router/requests/responses.py).
"""

from __future__ import annotations

from typing import Any

import orjson

from services.router.formats.responses import shapes

Event = dict[str, Any]


def encode(events: list[Event]) -> bytes:
    """Events in SSE framing, each named by its type (`event: <type>`), as OpenAI's."""
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (e["type"].encode(), orjson.dumps(e)) for e in events
    )


class ResponseEvents:
    """One streamed response's events so far; `output` holds its finished items."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._message: str | None = None  # the open message item's id
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []
        self._held: list[dict[str, Any]] = []  # logprobs of tokens whose text is not out yet

    def event(self, kind: str, **fields: Any) -> Event:
        event = {"type": f"response.{kind}", "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self, response: dict[str, Any]) -> list[Event]:
        return [self.event("created", response=response),
                self.event("in_progress", response=response)]  # fmt: skip

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """Text of the answer (and its tokens' logprobs, when asked): opens a message item
        first when none is open."""
        logprobs = self._held + (logprobs or [])
        if not delta:  # tokens without text yet (a partial character): their logprobs wait
            self._held = logprobs
            return []
        self._held = []
        events = []
        if self._message is None:
            self._message, self._text, self._logprobs = shapes.new_id("msg"), "", []
            item = shapes.message_item(self._message, "", "in_progress")
            events.append(self.event("output_item.added", output_index=len(self.output),
                                     item=item))  # fmt: skip
            events.append(self.event("content_part.added", **self._where(),
                                     part=shapes.output_text("")))  # fmt: skip
        self._text += delta
        self._logprobs += logprobs
        events.append(self.event("output_text.delta", **self._where(), delta=delta,
                                 logprobs=logprobs))  # fmt: skip
        return events

    def call(self, call: dict[str, Any]) -> list[Event]:
        """A whole tool call (a chat tool-call delta): its own function_call item."""
        events = self.close("completed")
        item_id, index = shapes.new_id("fc"), len(self.output)
        where = {"item_id": item_id, "output_index": index}
        arguments = call["function"]["arguments"]
        events.append(self.event("output_item.added", output_index=index,
                                 item=shapes.call_item(item_id, call, "in_progress")))  # fmt: skip
        events.append(self.event("function_call_arguments.delta", **where, delta=arguments))
        events.append(self.event("function_call_arguments.done", **where, arguments=arguments))
        item = shapes.call_item(item_id, call, "completed")
        self.output.append(item)
        events.append(self.event("output_item.done", output_index=index, item=item))
        return events

    def close(self, status: str) -> list[Event]:
        """End the open message item, if any, with `status`."""
        if self._message is None:
            return []
        where, text, lps = self._where(), self._text, self._logprobs + self._held
        self._held = []
        item = shapes.message_item(self._message, text, status, lps)
        self._message = None
        self.output.append(item)
        return [
            self.event("output_text.done", **where, text=text, logprobs=lps),
            self.event("content_part.done", **where, part=shapes.output_text(text, lps)),
            self.event("output_item.done", output_index=where["output_index"], item=item),
        ]

    def finish(self, response: dict[str, Any]) -> list[Event]:
        """The last events: the open item closed, then the whole response."""
        status = response["status"]
        events = self.close(status)
        response["output"] = self.output
        kind = "completed" if status == "completed" else status
        return [*events, self.event(kind, response=response)]

    def failed(self, response: dict[str, Any], error: dict[str, Any]) -> list[Event]:
        """The request failed after the stream began: `response.failed` with the error."""
        events = self.close("incomplete")
        response.update(output=self.output, status="failed", error=error)
        return [*events, self.event("failed", response=response)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._message, "output_index": len(self.output), "content_index": 0}
