"""Which constraint an OpenAI-API request asks its answer to obey, from whichever field asks for it.

OpenAI's `response_format` (`json_schema`, `json_object`), vLLM's older `guided_json` / `guided_regex` /
`guided_choice` and its newer `structured_outputs` all name one constraint: a JSON schema, a regex, or any JSON
object. `structured_output(body)` reads them into one (the server compiles it: inference/constraints.py,
inference/json_object.py) and names the field that asked, so errors name it too. A request may ask for one.
"""

from __future__ import annotations

import json
from typing import Any

from .openai_errors import ApiError


def response_format_of(response_format: Any) -> tuple[dict[str, Any] | None, bool]:
    """(the JSON schema a `response_format` asks for, whether it asks for any JSON object): (None, False) for text."""
    if response_format is None or response_format == {"type": "text"}:
        return None, False
    if response_format == {"type": "json_object"}:
        return None, True
    schema = response_format.get("json_schema", {}).get("schema") if isinstance(response_format, dict) else None
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema" or not isinstance(
            schema, dict):
        raise ApiError(f"response_format={response_format!r}: expected {{'type': 'text'}}, {{'type': 'json_object'}} "
                       "or {'type': 'json_schema', 'json_schema': {'schema': {...}}}", param="response_format")
    return schema, False


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older fields
REGEX_SPECIAL = set("\\.^$|?*+()[]{}")


def structured_output(body: dict[str, Any]) -> tuple[str | None, tuple[dict[str, Any] | None, str | None, bool]]:
    """(the field asking, (JSON schema, regex, any JSON object)) the answer is constrained to: OpenAI's
    `response_format`, or vLLM's `guided_json` / `guided_regex` / `guided_choice` (older) and `structured_outputs`
    ({"json" | "regex" | "choice" | "json_object": ...}, newer); at most one of them. (None, (None, None, False)):
    free text. Grammars are refused by name (no grammar engine here)."""
    asked: list[tuple[str, Any]] = []
    schema, json_object = response_format_of(body.get("response_format"))
    if schema is not None or json_object:
        asked.append(("response_format", None))
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            asked.append((name, body[name]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise ApiError(f"structured_outputs={outputs!r}: expected an object such as {{'json': {{...}}}}, "
                           "{'regex': ...}, {'choice': [...]} or {'json_object': true}", param="structured_outputs")
        asked += [(f"structured_outputs.{key}", value) for key, value in outputs.items() if value not in (None, False)]
    if len(asked) > 1:
        raise ApiError(f"{asked[0][0]} and {asked[1][0]} both constrain the answer: send one of them",
                       param=asked[1][0])
    if not asked:
        return None, (None, None, False)
    name, value = asked[0]
    kind = name.removeprefix("structured_outputs.").removeprefix("guided_")
    if kind == "response_format":
        return name, (schema, None, json_object)
    if kind == "json":
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as err:
            raise ApiError(f"{name}: not valid JSON ({err})", param=name) from err
        if not isinstance(value, dict):
            raise ApiError(f"{name}={value!r}: expected a JSON schema object", param=name)
        return name, (value, None, False)
    if kind == "json_object":
        return name, (None, None, True)
    if kind == "regex" and isinstance(value, str) and value:
        return name, (None, value, False)
    if kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
        escaped = ("".join("\\" + char if char in REGEX_SPECIAL else char for char in choice) for choice in value)
        return name, (None, "(" + "|".join(escaped) + ")", False)
    if kind == "grammar":
        raise ApiError(f"{name}: grammars are not supported (no grammar engine here): use a JSON schema or a regex",
                       param=name)
    expected = {"regex": "a non-empty regex string", "choice": "a non-empty list of non-empty strings"}.get(
        kind, "one of json, regex, choice, json_object")
    raise ApiError(f"{name}={value!r}: expected {expected}", param=name)
