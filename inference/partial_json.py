"""Partial JSON: how far each part of a JSON call that is still being written goes, for streaming tool calls.

`json_members` reads the members of an object whose text may stop anywhere; `partial_json_call` the call such an
object has begun (`{"name": ..., "arguments": {...}}`: its name once whole, its arguments' raw text as far as it goes);
`partial_json_list` the calls of a list of them. The raw text of a call's arguments, as the model wrote it, is also
what whole answers return (`tool_calls.keep_raw_arguments`), so what a stream sends is always the beginning of the
final arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

WHITESPACE = " \t\n\r"


@dataclass
class PartialCall:
    """A call begun in an answer's text: its name and the part of its arguments that the text already fixes."""

    name: str
    arguments: str = ""


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


# a whole JSON string (the unrolled form: fast on long strings), an opening quote that never closes, or a bracket
JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
JSON_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[\]{}]', re.S)
JSON_SCALAR = re.compile(r'[^,}\]\s]+')


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at `start` ends (one past its last character), or None if `text` ends first (a
    number or literal at the very end may still grow: None too). Does not check the value is valid JSON. Scans with
    regular expressions (no loop over characters in Python): streams call it on every piece of a growing answer."""
    first = text[start:start + 1]
    if first == '"':
        match = JSON_STRING.match(text, start)
        return None if match is None else match.end()
    if first in ("{", "["):
        depth = 0
        for match in JSON_STRUCTURE.finditer(text, start):
            token = match.group()
            if token == '"':  # a string still being written: the value goes on
                return None
            if token[0] == '"':
                continue
            depth += 1 if token in "{[" else -1
            if depth == 0:
                return match.end()
        return None
    match = JSON_SCALAR.match(text, start)
    return match.end() if match is not None and match.end() < len(text) else None


@dataclass
class Member:
    """One member of a partial JSON object: its key and where its value starts and ends (None: not yet)."""

    key: str
    start: int
    end: int | None


def json_members(text: str, start: int) -> tuple[list[Member], int | None]:
    """The members of the JSON object starting at `start` as far as `text` goes, and where the object ends (None: not
    yet, or not an object). A member is listed once its key is whole and its value has begun."""
    members: list[Member] = []
    if start >= len(text) or text[start] != "{":
        return members, None
    position = skip_whitespace(text, start + 1)
    if position < len(text) and text[position] == "}":
        return members, position + 1
    while position < len(text):
        key_end = value_end(text, position) if text[position] == '"' else None
        if key_end is None:
            return members, None
        key = json.loads(text[position:key_end])
        position = skip_whitespace(text, key_end)
        if position >= len(text) or text[position] != ":":
            return members, None
        position = skip_whitespace(text, position + 1)
        if position >= len(text):
            return members, None
        end = value_end(text, position)
        members.append(Member(key, position, end))
        if end is None:
            return members, None
        position = skip_whitespace(text, end)
        if position >= len(text) or text[position] not in ",}":
            return members, None
        if text[position] == "}":
            return members, position + 1
        position = skip_whitespace(text, position + 1)
    return members, None


def partial_json_call(text: str, start: int, arguments_keys: tuple[str, ...]) -> tuple[PartialCall | None, int | None]:
    """The call a partial `{"name": ..., <arguments key>: {...}}` at `start` has begun (None: no whole name yet), and
    where the object ends (None: not yet). The arguments are the raw text of an object or array value as far as it
    goes, a string value once whole (it holds the JSON), and `{}` when the object closed without arguments."""
    members, end = json_members(text, start)
    name = next((m for m in members if m.key == "name"), None)
    if name is None or name.end is None or text[name.start] != '"':
        return None, end
    call = PartialCall(json.loads(text[name.start:name.end]))
    arguments = next((m for m in members if m.key in arguments_keys), None)
    if arguments is None:
        call.arguments = "{}" if end is not None else ""
    elif text[arguments.start] in "{[":
        call.arguments = text[arguments.start:len(text) if arguments.end is None else arguments.end]
    elif text[arguments.start] == '"' and arguments.end is not None:
        value = json.loads(text[arguments.start:arguments.end])
        call.arguments = value if isinstance(value, str) else ""
    return call, end


def partial_json_calls(text: str, position: int, arguments_keys: tuple[str, ...],
                       next_object: Callable[[int], int]) -> list[PartialCall]:
    """The calls begun in call objects written one after another, the first at `position`: each next one starts
    where `next_object(end of the one before)` says (-1: none); reading stops at the first call not begun."""
    calls: list[PartialCall] = []
    while 0 <= position < len(text) and text[position] == "{":
        call, end = partial_json_call(text, position, arguments_keys)
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        position = next_object(end)
    return calls


def partial_json_list(text: str, arguments_keys: tuple[str, ...]) -> list[PartialCall]:
    """The calls begun in a partial JSON list of call objects (`[{"name": ..., "parameters": {...}}, ...]`)."""
    def after_comma(end: int) -> int:
        position = skip_whitespace(text, end)
        return skip_whitespace(text, position + 1) if text.startswith(",", position) else -1

    position = skip_whitespace(text, 0)
    if not text.startswith("[", position):
        return []
    return partial_json_calls(text, skip_whitespace(text, position + 1), arguments_keys, after_comma)
