"""JSON extraction: the same instructions and worked examples before each text, then a
record constrained to a JSON schema and a yes/no field chosen with `select`. Across a
batch, the instructions are a prefix every call shares."""

from __future__ import annotations

import json
import sys
from typing import Any

from llm_programs import State, function
from llm_programs.examples import cli

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "job": {"type": "string"},
    },
    "required": ["name", "age", "city", "job"],
    "additionalProperties": False,
}
INSTRUCTIONS = """Extract the person described in each text as JSON with the keys name, \
age, city and job, then say whether they are retired.

Text: Maria Lopez, 34, works as a nurse at the central hospital in Valencia.
JSON: {"name": "Maria Lopez", "age": 34, "city": "Valencia", "job": "nurse"}
Retired: no

Text: After forty years at the post office, Henri Dubois (71) now tends his garden in Lyon.
JSON: {"name": "Henri Dubois", "age": 71, "city": "Lyon", "job": "postman"}
Retired: yes

Text: Aiko Tanaka is a 28-year-old software engineer who moved to Osaka last spring.
JSON: {"name": "Aiko Tanaka", "age": 28, "city": "Osaka", "job": "software engineer"}
Retired: no

"""
PEOPLE = (
    ("Tom Becker", 45, "Hamburg", "baker", "has run the bakery on the corner since 2001"),
    ("Lena Novak", 67, "Prague", "teacher", "taught chemistry until she retired last year"),
    ("Omar Haddad", 39, "Amman", "architect", "designs schools for a small studio"),
    ("Grace Mensah", 52, "Accra", "judge", "sits on the high court"),
    ("Pablo Ruiz", 74, "Seville", "carpenter", "no longer works but still builds chairs"),
    ("Sofia Rossi", 31, "Turin", "pilot", "flies regional routes for an airline"),
    ("Ivan Petrov", 58, "Sofia", "doctor", "runs a clinic in the old town"),
    ("Nora Lind", 23, "Uppsala", "student", "studies biology and works in a cafe"),
)


@function
async def json_extraction(s: State, text: str) -> None:
    """`record` (JSON text, schema SCHEMA) and `retired` (' yes' or ' no') for `text`."""
    s += INSTRUCTIONS + f"Text: {text}\nJSON: "
    await s.gen("record", 64, json_schema=SCHEMA, temperature=0)
    s += "\nRetired:"
    await s.select("retired", [" yes", " no"])


program = json_extraction


def inputs(n: int) -> list[dict[str, Any]]:
    texts = []
    for i in range(n):
        name, age, city, _, what = PEOPLE[i % len(PEOPLE)]
        texts.append({"text": f"{name}, aged {age}, lives in {city} and {what}."})
    return texts


def show(state: State) -> dict[str, Any]:
    return {"record": json.loads(state["record"]), "retired": state["retired"].strip()}


def main(argv: list[str] | None = None) -> int:
    return cli.main(program, inputs, show, argv)


if __name__ == "__main__":
    sys.exit(main())
