"""The model and tokenizer endpoints of a real router process (they need no worker):
GET /v1/models/{id} through the openai client, GET /version, POST /tokenize and
/detokenize in vLLM's shapes, behind the API key; every aiohttp error (no route, wrong
method, body too large) in OpenAI's four-key shape."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from libs.common import __version__
from libs.common.engine.load.source import default_model_path, load_tokenizer
from services.router.config import RouterConfig
from services.router.requests.prompts import encode, render_chat
from tests.router.conftest import Routers

KEY = "sk-endpoints"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def router(module_nats, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    keys = logs / "keys.txt"
    keys.write_text(f"{KEY}\n")
    routers = Routers(module_nats.url, logs)
    try:
        yield routers.start("router-endpoints", "--api-keys-file", str(keys))
    finally:
        routers.stop()


@pytest.fixture(scope="module")
def tokenizer():
    tok, _, _ = load_tokenizer(default_model_path())
    return tok


def four_keys(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def post(router: str, path: str, body: object, headers=AUTH) -> tuple[int, dict]:
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(f"{router}{path}", json=body) as r:
            return r.status, await r.json()


async def test_models_retrieve_returns_the_served_model_and_404s_another(router):
    client = openai.AsyncOpenAI(base_url=f"{router}/v1", api_key=KEY, max_retries=0)
    (listed,) = (await client.models.list()).data
    model = await client.models.retrieve(listed.id)
    assert (model.id, model.object, model.created) == (listed.id, "model", listed.created)
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("org/no-such-model")
    error = four_keys(e.value.response.json())
    assert error["code"] == "model_not_found" and "org/no-such-model" in error["message"]


async def test_version_is_the_packages(router):
    async with aiohttp.ClientSession() as http, http.get(f"{router}/version") as r:
        assert r.status == 200 and await r.json() == {"version": __version__}


async def test_tokenize_gives_the_ids_the_completion_endpoints_run(router, tokenizer):
    status, body = await post(router, "/tokenize", {"model": "default", "prompt": "Hello there"})
    ids = encode(tokenizer, "Hello there")
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] > len(ids) and "token_strs" not in body
    status, body = await post(router, "/tokenize", {"messages": MESSAGES,
                                                    "return_token_strs": True})  # fmt: skip
    ids = encode(tokenizer, render_chat(tokenizer, MESSAGES))
    assert status == 200 and body["tokens"] == ids
    assert body["token_strs"] == [tokenizer.tokenizer.id_to_token(i) for i in ids]
    _, bare = await post(router, "/tokenize", {"messages": MESSAGES,
                                               "add_generation_prompt": False})  # fmt: skip
    assert bare["count"] < body["count"] and ids[: bare["count"]] == bare["tokens"]


async def test_detokenize_inverts_tokenize(router):
    text = "Tokens, and back again."
    _, tokens = await post(router, "/tokenize", {"prompt": text})
    status, body = await post(router, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and body["prompt"].endswith(text)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
         "continue_final_message"),
    ],
)  # fmt: skip
async def test_bad_tokenizer_requests_are_400_naming_the_field(router, path, body, param):
    status, out = await post(router, path, body)
    assert status == 400 and four_keys(out)["param"] == param


async def test_tokenizer_endpoints_are_behind_the_api_key(router):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, out = await post(router, path, body, headers={})
        assert status == 401 and four_keys(out)["code"] == "invalid_api_key"
    status, out = await post(router, "/tokenize", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and four_keys(out)["code"] == "model_not_found"


async def test_aiohttp_errors_are_openai_shaped(router):
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.get(f"{router}/no/such/route") as r:
            assert r.status == 404 and "/no/such/route" in four_keys(await r.json())["message"]
        async with http.get(f"{router}/tokenize") as r:
            assert r.status == 405 and "POST" in r.headers["Allow"]
            four_keys(await r.json())
        limit = RouterConfig().max_body_bytes  # the default --max-body-bytes
        async with http.post(f"{router}/tokenize", data=b"x" * (limit + 1)) as r:
            assert r.status == 413
            error = four_keys(await r.json())
            assert error["type"] == "invalid_request_error" and str(limit) in error["message"]


async def test_chat_render_takes_the_chat_template_fields(router):
    messages = [*MESSAGES, {"role": "assistant", "content": "Hello, I am"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    status, out = await post(router, "/v1/chat/render", body)
    assert status == 200 and out["prompt"].endswith("Hello, I am")
    _, tokens = await post(router, "/tokenize", body)
    assert out["prompt_tokens"] == tokens["count"]
    status, out = await post(router, "/v1/chat/render", {**body, "chat_template_kwargs": 3})
    assert status == 400 and four_keys(out)["param"] == "chat_template_kwargs"
