"""How a chat request asks its messages to be rendered: vLLM's chat template fields.

    add_generation_prompt   open the assistant's turn after the messages (default true)
    continue_final_message  leave the last (assistant) message open: the model continues
                            it, a prefill of its answer; excludes add_generation_prompt true
    chat_template_kwargs    more variables for the template (e.g. enable_thinking)

The render itself is services/router/requests/prompts.py's `render_chat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.router.errors import bad_request

FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# Variables the server sets itself; a kwarg may not replace them.
RESERVED = (
    "messages", "add_generation_prompt", "continue_final_message", "tools", "bos_token",
    "eos_token", "raise_exception",
)  # fmt: skip


@dataclass(frozen=True)
class TemplateArgs:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


DEFAULT_TEMPLATE = TemplateArgs()


def template_args(body: dict[str, Any], messages: list[dict[str, Any]]) -> TemplateArgs:
    """The fields above from `body` (its `messages` already parsed); a 400 naming the
    field when one is malformed or they contradict each other or the messages."""
    for name in FIELDS[:2]:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"'{name}' must be a boolean", name)
    generation, cont = body.get("add_generation_prompt"), bool(body.get("continue_final_message"))
    if cont and generation:
        raise bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            "continue_final_message",
        )
    if cont and (messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip()):
        raise bad_request(
            "'continue_final_message' needs the last message to be an assistant's, with "
            "the text to continue",
            "continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    taken = sorted(set(kwargs) & set(RESERVED))
    if taken:
        raise bad_request(
            f"'chat_template_kwargs' may not set '{taken[0]}': the server sets it",
            "chat_template_kwargs",
        )
    return TemplateArgs(not cont if generation is None else generation, cont, kwargs)


def cut_after_final(text: str, final: str) -> str:
    """`text` (a rendered chat) ending right after the last message's content `final`:
    what the template put after it (the end of the turn) is dropped."""
    for needle in (final, final.strip()):
        at = text.rfind(needle)
        if needle and at >= 0:
            return text[: at + len(needle)]
    raise bad_request(
        "'continue_final_message': the chat template does not keep the last message's text",
        "continue_final_message",
    )
