"""The HTTP API of a real router process, no workers: errors, auth, health, models, metrics.

Every error is OpenAI-shaped with the right status; the official `openai` client raises
the matching exception class. Cases that need live workers (429 under load, usage) are
in test_router_e2e.py.
"""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.router.conftest import Routers

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def router(module_nats, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    keys = logs / "keys.txt"
    keys.write_text(f"# test keys\n{KEY}\n")
    routers = Routers(module_nats.url, logs)
    try:
        url = routers.start("router-api", "--api-keys-file", str(keys))
        yield url
    finally:
        routers.stop()


@pytest.fixture
def client(router):
    return openai.AsyncOpenAI(base_url=f"{router}/v1", api_key=KEY, max_retries=0, timeout=30)


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in exc.response.text
    return body["error"]


async def test_no_workers_is_503_with_retry_after(client):
    with pytest.raises(openai.InternalServerError) as e:
        await client.completions.create(model="default", prompt="hi", max_tokens=2)
    assert e.value.status_code == 503
    assert e.value.response.headers["Retry-After"] == "1"
    assert error_of(e.value)["code"] == "no_workers"


async def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert error_of(e.value)["param"] == "model"


async def test_wrong_key_is_401(router):
    wrong = openai.AsyncOpenAI(base_url=f"{router}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        await wrong.models.list()
    assert error_of(e.value)["type"] == "authentication_error"


async def test_missing_key_is_401(router):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{router}/v1/completions", json={"model": "default"}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert (await r.json())["error"]["code"] == "invalid_api_key"


async def test_out_of_range_and_wrong_type_values_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="default", prompt="hi", temperature=7)
    assert error_of(e.value)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}],
            extra_body={"top_k": "many"},
        )  # fmt: skip
    assert error_of(e.value)["param"] == "top_k"


async def test_admission_comes_before_tokenization_so_no_worker_is_503_first(client):
    # Prompts are tokenized only once admitted (a live decode worker, room in the bound):
    # with no worker, even a prompt past the context is a 503, not a 400 (the 400 with both
    # lengths: tests/router/test_router_validation.py, and with workers tests/hostile).
    with pytest.raises(openai.InternalServerError) as e:
        await client.completions.create(model="default", prompt=[1] * 8190, max_tokens=10)
    assert e.value.status_code == 503 and e.value.response.headers["Retry-After"]


async def test_malformed_json_and_non_object_bodies_are_400(router):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for raw in (b"{not json", b"[1, 2]", b"", "\u00e9".encode("latin-1")):
            async with http.post(f"{router}/v1/chat/completions", data=raw) as r:
                assert r.status == 400, raw
                body = await r.json()
                assert body["error"]["type"] == "invalid_request_error"


async def test_unknown_path_and_wrong_method_are_openai_shaped(router):
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(f"{router}/v1/nothing") as r:
            assert r.status == 404 and "error" in await r.json()
        async with http.get(f"{router}/v1/completions") as r:
            assert r.status == 405 and "error" in await r.json()


async def test_request_id_is_echoed_or_generated(router):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{router}/health", headers={"x-request-id": "my-id_1"}) as r:
            assert r.headers["x-request-id"] == "my-id_1"
        async with http.get(f"{router}/health", headers={"x-request-id": "bad id!"}) as r:
            rid = r.headers["x-request-id"]
            assert rid != "bad id!" and rid.isalnum()


async def test_health_is_503_without_workers_and_needs_no_key(router):
    async with aiohttp.ClientSession() as http, http.get(f"{router}/health") as r:
        assert r.status == 503
        body = await r.json()
        assert body["status"] == "unavailable" and body["nats"] is True
        assert body["workers"] == {"prefill": 0, "decode": 0, "both": 0}


async def test_models_lists_the_served_model(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["default"]


async def test_metrics_exposes_vllm_style_names(router):
    async with aiohttp.ClientSession() as http, http.get(f"{router}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    for name in ("tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds",
                 "tandem:e2e_request_latency_seconds", "tandem:request_queue_time_seconds",
                 "tandem:num_requests_running", "tandem:kv_index_keys",
                 'tandem:request_failure_total{model_name="default",status="503"}'):  # fmt: skip
        assert name in text, name


async def test_streaming_request_that_cannot_start_gets_a_status_not_a_stream(client):
    with pytest.raises(openai.InternalServerError) as e:
        await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    assert e.value.status_code == 503
