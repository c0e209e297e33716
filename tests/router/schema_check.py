"""A small JSON-schema checker for the subset /openapi.json uses (no jsonschema dependency).

Supports $ref, type (incl. lists and "null"), required, properties, items, const, enum,
oneOf, minimum, maximum, exclusiveMinimum. Returns a list of problems, empty when valid.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": dict, "array": list, "string": str, "boolean": bool,
    "integer": int, "number": (int, float), "null": type(None),
}  # fmt: skip


def check(value: Any, schema: dict, doc: dict, path: str = "$") -> list[str]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return check(value, doc["components"]["schemas"][name], doc, path)
    problems: list[str] = []
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(
            isinstance(value, _TYPES[k])
            and not (k in ("integer", "number") and value is True)
            and not (k in ("integer", "number") and value is False)
            for k in kinds
        )
        if not ok:
            return [f"{path}: {value!r} is not {kinds}"]
    if "const" in schema and value != schema["const"]:
        problems.append(f"{path}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} not in {schema['enum']}")
    if "oneOf" in schema:
        matches = [s for s in schema["oneOf"] if not check(value, s, doc, path)]
        if len(matches) != 1:
            problems.append(f"{path}: matches {len(matches)} of oneOf")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{path}: {value} > {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            problems.append(f"{path}: {value} <= {schema['exclusiveMinimum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}: missing {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                problems += check(value[key], sub, doc, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += check(item, schema["items"], doc, f"{path}[{i}]")
    return problems


def response_schema(doc: dict, path: str, method: str, status: int) -> dict:
    response = doc["paths"][path][method.lower()]["responses"][str(status)]
    return response["content"]["application/json"]["schema"]
