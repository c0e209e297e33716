"""The prefix a fork's branches share, and why it is sent once before they start."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from llm_programs.calls import prefix_body

if TYPE_CHECKING:
    from llm_programs.state import State


class SharedPrefix:
    """What a fork's branches share, sent to the router once, before the first branch's
    first call: branches started side by side would otherwise each compute it (none finds
    it cached yet). One completion of one token, discarded, recorded on the parent as a
    `prefix` call. In a chat, the shared part is the conversation so far, rendered."""

    def __init__(self, parent: State, n: int):
        self.parent, self.label = parent, f"{parent.program}: fork({n}) prefix"
        self.text, self.messages = parent._text, parent._messages and parent.messages
        self._task: asyncio.Future | None = None

    async def ready(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._send())
        await asyncio.shield(self._task)  # one branch cancelled leaves it to the others

    async def _send(self) -> None:
        router, prompt = self.parent.router, self.text
        if self.messages:
            prompt = await router.render(self.label, self.messages, False)
        if prompt:
            body = prefix_body(router.model, prompt)
            await self.parent._timed(self.label, "prefix", body, router.complete(self.label, body))
