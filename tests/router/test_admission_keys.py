"""API keys and tenants (services/router/admission/tenants.py, credentials.py): the keys
file's two formats, keys kept as digests, every malformed header a 401 (never another
error), and the cache salt rooted in the tenant. Pure Python."""

from __future__ import annotations

import hashlib

import pytest

from services.router.admission.credentials import presented_key, tenant_of
from services.router.admission.tenants import DEFAULT, KeyRing, Tenant, cache_salt, load_keys
from services.router.errors import ApiError

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


TOML = f"""
[tenants.a]
weight = 2
max_concurrency = 4
tokens_per_minute = 60000

[tenants.b]
cache_group = "docs"

[[keys]]
hash = "{sha(KEY_A)}"
tenant = "a"

[[keys]]
hash = "{sha(KEY_B)}"
tenant = "b"
"""


def test_the_toml_file_names_each_keys_tenant_and_its_limits(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(TOML)
    ring = load_keys("", str(path))
    a, b = ring.tenant(KEY_A), ring.tenant(KEY_B)
    assert a == Tenant("a", 2.0, 4, 60000, 0, "tenant:a")
    assert b is not None and b.name == "b" and b.cache_scope == "group:docs"
    assert ring.tenant(KEY_A + "x") is None and ring.tenant("") is None


def test_keys_are_held_as_digests_only(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(TOML)
    ring = load_keys("sk-plain-flag-key", str(path))
    held = repr(vars(ring))
    assert KEY_A not in held and "sk-plain-flag-key" not in held
    assert ring.tenant("sk-plain-flag-key") is DEFAULT


def test_the_older_one_key_a_line_file_still_works_hashed_or_plain(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# comment\n{KEY_A}\n\n{sha(KEY_B)}\n")
    ring = load_keys("", str(path))
    assert ring.tenant(KEY_A) is DEFAULT and ring.tenant(KEY_B) is DEFAULT and len(ring) == 2


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[tenants.a]\nweight = 0\n[[keys]]\nhash = 'sha256:" + "0" * 64 + "'\ntenant = 'a'",
         "weight"),
        ("[tenants.a]\nspeed = 1\n", "fields are"),
        ("[[keys]]\nhash = 'sha256:" + "0" * 64 + "'\ntenant = 'nobody'", "no [tenants.nobody]"),
        ("[tenants.a]\n[[keys]]\nhash = 'md5:00'\ntenant = 'a'", "sha256"),
        ("[tenants.a]\n", "no [[keys]]"),
        ("[tenants.a]\nshare_cache = true\ncache_group = 'x'\n", "one or the other"),
        ("not toml at all", "not valid TOML"),
    ],
)  # fmt: skip
def test_a_wrong_keys_file_stops_the_start_naming_the_flag(tmp_path, text, fragment):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_keys("", str(path))
    assert "--api-keys-file" in str(e.value) and fragment in str(e.value)


# Headers as aiohttp hands them over: bytes that are not UTF-8 arrive as surrogates.
MALFORMED = {
    "non-UTF-8 bytes": {"Authorization": "Bearer sk-\udcff\udcfe"},
    "non-ASCII": {"Authorization": "Bearer sk-clé"},
    "control character": {"Authorization": "Bearer sk-a\x01b"},
    "tab inside": {"x-api-key": "sk-a\tb"},
    "empty bearer": {"Authorization": "Bearer "},
    "bearer alone": {"Authorization": "Bearer"},
    "another scheme": {"Authorization": f"Basic {KEY_A}"},
    "overlong": {"Authorization": "Bearer " + "k" * 5000},
    "non-UTF-8 x-api-key": {"x-api-key": "\udcc3\udc28"},
    "no header": {},
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_credential_is_401(name):
    ring = KeyRing({hashlib.sha256(KEY_A.encode()).digest(): Tenant("a")})
    with pytest.raises(ApiError) as e:
        tenant_of(MALFORMED[name], ring)
    assert e.value.status == 401 and e.value.code == "invalid_api_key"


def test_either_header_presents_the_key():
    assert presented_key({"Authorization": f"bearer  {KEY_A} "}) == KEY_A
    assert presented_key({"x-api-key": KEY_A}) == KEY_A
    assert presented_key({"Authorization": "Basic x", "x-api-key": KEY_A}) == KEY_A
    assert tenant_of({}, KeyRing()) is DEFAULT  # no keys: one default tenant


def test_a_tenants_salt_never_equals_another_scopes_or_a_clients():
    a, b = Tenant("a", cache_scope="tenant:a"), Tenant("b", cache_scope="tenant:b")
    salts = {cache_salt(t, s) for t in (a, b) for s in ("", "x", "tenant:a")}
    assert len(salts) == 6
    assert cache_salt(a, "x") == cache_salt(a, "x")  # the same tenant reuses its pages
    assert cache_salt(DEFAULT, "") == "" and cache_salt(DEFAULT, "x") == "x"
    shared = Tenant("s", cache_scope="shared")
    assert cache_salt(shared, cache_salt(a, "")) != cache_salt(a, "")


def test_the_cost_estimate_counts_texts_and_ids_without_walking_the_ids():
    from services.router.admission.request import estimate_tokens

    assert estimate_tokens("abcd" * 100) == 101
    assert estimate_tokens(list(range(5000))) == 5000
    assert estimate_tokens([[1, 2, 3], [4, 5]]) == 5
    messages = [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": ""}]
    assert 100 <= estimate_tokens(messages) <= 110


async def test_a_large_body_is_sized_not_walked_for_the_estimate():
    """Past WALK_BYTES the estimate is the body's bytes / CHARS_PER_TOKEN (content-length
    or chunked), through a real aiohttp server; a small body is walked."""
    import aiohttp
    import orjson
    from aiohttp import web

    from services.router.admission.request import CHARS_PER_TOKEN, WALK_BYTES, _estimate

    async def handler(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        return web.json_response({"estimate": await _estimate(request, body["messages"])})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    many = orjson.dumps({"messages": [{"role": "user", "content": "x"}] * 20000})
    small = orjson.dumps({"messages": [{"role": "user", "content": "x" * 400}]})
    assert len(many) > WALK_BYTES > len(small)

    async def chunked(data: bytes):
        yield data

    try:
        async with aiohttp.ClientSession() as http:
            got = []
            for data in (many, chunked(many), small):
                async with http.post(url, data=data) as r:
                    got.append((await r.json())["estimate"])
    finally:
        await runner.cleanup()
    assert got[0] == got[1] == len(many) // CHARS_PER_TOKEN + 1
    assert 100 <= got[2] <= 110  # walked: the text's 400 characters
