"""Constrained decoding end to end: response_format, regex and ebnf through a real cluster
(tests/router/structured_cluster.py; tool calls: test_tool_calling.py).

Answers are sampled at temperature 1 with a seed (the cached-prefix test excepted: it is
greedy), so only an enforced grammar makes them valid. Every prompt is long, so the router
disaggregates it: the prefill worker samples the first token under the grammar and the
decode worker goes on from it.

Slow (the workers load the model): marked `slow`. Requests within a test run concurrently.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any, Literal

import openai
import pydantic
import pytest

from tests.router.structured_cluster import (
    PERSON,
    long_messages,
    long_prompt,
    post,
    prefill_routes,
    schema_errors,
    schema_format,
    structured_fixtures,
)

pytestmark = pytest.mark.slow

cluster, c = structured_fixtures("structured-logs")


# -- a deterministic generator of JSON schemas whose every valid value is short ------------

_WORDS = ("name", "city", "color", "score", "tags", "size", "owner", "kind", "level", "note")
_PATTERNS = ("^[A-Z][a-z]{1,8}$", "^[0-9]{3}-[0-9]{4}$", "^(red|green|blue)$",
             "^[a-z]{2,5}_[0-9]{1,3}$")  # fmt: skip


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "pattern", "enum", "integer", "number", "boolean", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(4, 16)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(["alpha", "beta", "gamma", "delta", 1, 2, 3, True], 3)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10.5, "maximum": rng.choice([0.5, 7, 99.25])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low = rng.randint(0, 2)
        items = _value_schema(rng, 2)  # scalars only: arrays stay short
        return {"type": "array", "items": items, "minItems": low,
                "maxItems": low + rng.randint(1, 2)}  # fmt: skip
    return object_schema(rng, depth + 1)


def object_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema: 2-4 properties, some required, no others allowed."""
    names = rng.sample(_WORDS, rng.randint(2, 4 if depth == 0 else 3))
    props = {n: _value_schema(rng, depth) for n in names}
    required = sorted(rng.sample(names, rng.randint(1, len(names))))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


def generated_schemas(count: int, seed: int = 2024) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [object_schema(rng) for _ in range(count)]


# -- response_format, regex, ebnf ----------------------------------------------------------


async def test_a_long_constrained_prompt_is_prefilled_by_a_prefill_worker(cluster, c):
    before = await prefill_routes(cluster.url)
    r = await c.chat.completions.create(
        model="default", messages=long_messages("Describe a person."), max_tokens=300,
        temperature=1.0, seed=1, response_format=schema_format(PERSON),
    )  # fmt: skip
    assert r.usage.prompt_tokens > 256
    assert await prefill_routes(cluster.url) - before == 1
    assert not schema_errors(r.choices[0].message.content, PERSON)


async def test_every_generated_schema_is_followed_and_ends_with_stop(cluster, c):
    schemas = generated_schemas(16)

    async def one(i: int, schema: dict[str, Any]) -> str:
        try:
            r = await c.chat.completions.create(
                model="default", messages=long_messages("Fill in the record."), max_tokens=500,
                temperature=1.0, seed=100 + i, response_format=schema_format(schema, f"s{i}"),
            )  # fmt: skip
        except openai.APIError as e:  # reported with the others, not instead of them
            return f"schema {i}: {e!r}"
        choice = r.choices[0]
        why = schema_errors(choice.message.content, schema)
        if choice.finish_reason != "stop":
            why += f" finish_reason={choice.finish_reason}"
        return f"schema {i} {json.dumps(schema)}: {why}" if why else ""

    failures = await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
    assert not [f for f in failures if f], "\n".join(f for f in failures if f)


@pytest.mark.parametrize(
    "pattern, ask",
    [
        ("[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "Give a date."),
        (r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "Give a phone number."),
        ("(yes|no)", "Is the sky green?"),
        ("[a-z]{1,8}@[a-z]{1,8}\\.(com|org|net)", "Give an email address."),
    ],
)
async def test_regex_output_fully_matches(cluster, c, pattern, ask):
    async def one(seed: int) -> str:
        r = await c.chat.completions.create(
            model="default", messages=long_messages(ask), max_tokens=40, temperature=1.0,
            seed=seed, extra_body={"regex": pattern},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    outputs = await asyncio.gather(*(one(seed) for seed in range(3)))
    assert all(re.fullmatch(pattern, text) for text in outputs), outputs


async def test_regex_on_the_completions_endpoint_fully_matches(cluster, c):
    pattern = "[0-9]{2}:[0-9]{2} (am|pm)"
    r = await c.completions.create(model="default", prompt=long_prompt("What time is it?"),
                                   max_tokens=20, temperature=1.0, seed=3,
                                   extra_body={"regex": pattern})  # fmt: skip
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


async def test_a_schema_on_the_completions_endpoint_is_followed(cluster, c):
    r = await c.completions.create(
        model="default", prompt=long_prompt("A person as JSON:"), max_tokens=300,
        temperature=1.0, seed=21, extra_body={"response_format": schema_format(PERSON)},
    )  # fmt: skip
    assert not schema_errors(r.choices[0].text, PERSON)
    assert r.choices[0].finish_reason == "stop"


async def test_json_object_answers_are_json_objects_or_a_prefix_cut_by_max_tokens(cluster, c):
    # Any object at all: nothing bounds its strings, so at temperature 1 about one answer in
    # eight runs on to max_tokens; those must still be the start of an object.
    async def one(seed: int) -> tuple[str, str]:
        r = await c.chat.completions.create(
            model="default", messages=long_messages("Give a tiny JSON object with one key."),
            max_tokens=120, temperature=1.0, seed=seed,
            response_format={"type": "json_object"},
        )  # fmt: skip
        return r.choices[0].finish_reason, r.choices[0].message.content

    answers = await asyncio.gather(*(one(seed) for seed in range(4)))
    stopped = [text for reason, text in answers if reason == "stop"]
    assert stopped and all(isinstance(json.loads(text), dict) for text in stopped), answers
    assert all(text.startswith("{") for _, text in answers), answers


@pytest.mark.parametrize(
    "grammar, equivalent",
    [
        ('root ::= greeting " " name " " num\n'
         'greeting ::= "hello" | "hi"\n'
         'name ::= "alice" | "bob" | "carol"\n'
         "num ::= [0-9] [0-9]?",
         "(hello|hi) (alice|bob|carol) [0-9][0-9]?"),
        ('root ::= "(" item ("," item)? ")"\nitem ::= [a-c] | "x" [0-9]',
         r"\(([a-c]|x[0-9])(,([a-c]|x[0-9]))?\)"),
        ('start: ANIMAL " says " SOUND\nANIMAL: "cat" | "dog"\nSOUND: "meow" | "woof"',
         "(cat|dog) says (meow|woof)"),
    ],
    ids=["gbnf", "gbnf-nested", "lark"],
)  # fmt: skip
async def test_ebnf_output_follows_the_grammar(cluster, c, grammar, equivalent):
    async def one(seed: int) -> str:
        r = await c.chat.completions.create(
            model="default", messages=long_messages("Say something."), max_tokens=30,
            temperature=1.0, seed=seed, extra_body={"ebnf": grammar},
        )  # fmt: skip
        return r.choices[0].message.content

    outputs = await asyncio.gather(*(one(seed) for seed in range(3)))
    assert all(re.fullmatch(equivalent, text) for text in outputs), outputs


async def test_streamed_deltas_concatenate_to_json_valid_against_the_schema(cluster, c):
    stream = await c.chat.completions.create(
        model="default", messages=long_messages("Describe a person."), max_tokens=300,
        temperature=1.0, seed=11, response_format=schema_format(PERSON), stream=True,
    )  # fmt: skip
    pieces, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert not schema_errors("".join(pieces), PERSON)


async def test_every_one_of_n_choices_is_valid_against_the_schema(cluster, c):
    r = await c.chat.completions.create(
        model="default", messages=long_messages("Describe a person."), max_tokens=300,
        temperature=1.0, seed=5, n=3, response_format=schema_format(PERSON),
    )  # fmt: skip
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    errors = [schema_errors(ch.message.content, PERSON) for ch in r.choices]
    assert not any(errors), errors
    assert all(ch.finish_reason == "stop" for ch in r.choices)


async def test_a_schema_that_cannot_finish_in_max_tokens_ends_with_length(cluster, c):
    schema = {"type": "array", "items": {"type": "string", "minLength": 5, "maxLength": 10},
              "minItems": 30}  # fmt: skip
    r = await c.chat.completions.create(
        model="default", messages=long_messages("List words."), max_tokens=8,
        temperature=1.0, seed=2, response_format=schema_format(schema),
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.choices[0].message.content.startswith('["')


async def test_a_constrained_request_on_a_cached_prefix_matches_the_cold_one(cluster, c):
    kwargs = dict(model="default", messages=long_messages("Describe a person."),
                  max_tokens=300, temperature=0, response_format=schema_format(PERSON))  # fmt: skip
    cold = await c.chat.completions.create(**kwargs)
    await asyncio.sleep(1.0)  # the holders' KV events reach the router
    warm = await c.chat.completions.create(**kwargs)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert not schema_errors(cold.choices[0].message.content, PERSON)


_SCHEMA_FOO = {"response_format": schema_format({"type": "foo"})}
_UNIQUE = {"response_format": schema_format({"type": "array", "uniqueItems": True})}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    "extra, params",
    [
        (_SCHEMA_FOO, {"response_format"}),
        (_UNIQUE, {"response_format"}),
        ({"response_format": {"type": "xml"}}, {"response_format"}),
        ({"response_format": {"type": "json_schema"}}, {"response_format"}),
        ({"regex": "[a-"}, {"regex"}),
        ({"regex": "(?=a)b"}, {"regex"}),
        ({"ebnf": "root ::= ("}, {"ebnf"}),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, {"regex", "ebnf"}),
        ({"response_format": {"type": "json_object"}, "regex": "a"},
         {"response_format", "regex"}),
    ],
    ids=["invalid-type", "unsupported-keyword", "unknown-format", "no-json-schema",
         "bad-regex", "lookaround", "bad-ebnf", "regex-and-ebnf", "json-and-regex"],
)  # fmt: skip
async def test_bad_grammar_input_is_a_400_naming_the_field(cluster, path, extra, params):
    body: dict[str, Any] = {"model": "default", "max_tokens": 4, **extra}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    status, reply = await post(cluster.url, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] in params, reply


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(min_length=1, max_length=16)
    zip: str = pydantic.Field(pattern="^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address


async def test_openai_parse_with_a_pydantic_model_returns_the_parsed_object(cluster, c):
    r = await c.chat.completions.parse(
        model="default", messages=long_messages("Describe a user."), max_tokens=200,
        temperature=1.0, seed=4, response_format=Person,
    )  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and 0 <= parsed.age <= 120
    assert r.choices[0].finish_reason == "stop"
