"""POST /v1/chat/render: the prompt text a chat request would become, without running it.

A client that drives /v1/completions with its own text (the llm_programs frontend: gens,
selects and forks that share prefixes) renders chat turns through the model's template
here, so its prompts are the ones /v1/chat/completions would build, token for token.

    {"messages": [...], "add_generation_prompt": true}
      -> {"object": "chat.prompt", "prompt": "<text>", "prompt_tokens": n}

`model` is optional (checked when given); `continue_final_message` and
`chat_template_kwargs` work as on /v1/chat/completions (chat_template.py); any other
field is refused. Decoding and checks, then the template and the tokenizer, run on the
router's CPU thread (a 2,000-message body is tens of milliseconds of Python): never on
the event loop.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from services.router.admission import budget
from services.router.admission.request import light
from services.router.formats.bodies import check_model, closed_object, read
from services.router.formats.openai import chat_template
from services.router.formats.openai.messages import parse_messages
from services.router.requests.prompts import encode, render_chat
from services.router.state import STATE
from services.router.structured.tools.request import check_tool_messages

FIELDS = ("model", "messages", *chat_template.FIELDS)


async def chat_render(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config, raw = state.config, await read(request)

    def parse() -> tuple[list[dict], chat_template.TemplateArgs]:
        body = closed_object(budget.decoded(raw, config), FIELDS, "/v1/chat/render")
        if body.get("model") is not None:
            check_model(state, body["model"])
        messages = parse_messages(body.get("messages"))
        budget.check_messages(messages, config)
        check_tool_messages(body["messages"])
        return messages, chat_template.template_args(body, messages)

    messages, template = await state.cpu_work(parse)

    def render() -> bytes:
        text = render_chat(state.tokenizer, messages, None, template)
        n = len(encode(state.tokenizer, text))
        return orjson.dumps({"object": "chat.prompt", "prompt": text, "prompt_tokens": n})

    async with light(request, messages):  # template and tokenizer: CPU, off the loop
        out = await state.cpu_work(render)
    return web.Response(body=out, content_type="application/json")
