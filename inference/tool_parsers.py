"""Tool-call parsers: read the calls a model wrote in its own format out of an answer's text (tool_choice "auto").

Each parser has `parse(text, tools) -> (content, calls)` (an answer holding no call that parses is all content: calls
are read, never repaired) and `content_length(text)`: how much of a growing answer is surely content, so a stream can
send it before the answer ends, and `partial_calls(text, tools)`: the calls a growing answer has begun, so a stream
sends them as they are written (inference/tool_call_stream.py). A parser with `new_call_id` makes its calls' ids
(Mistral's 9 characters). `detect_parser` picks the parser a chat template's call format needs.

| parser        | the model writes                                                      | models                       |
|---------------|-----------------------------------------------------------------------|------------------------------|
| `hermes`      | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`            | Qwen2.5, Qwen3, Hermes       |
| `qwen3_coder` | `<tool_call><function=NAME><parameter=KEY>value</parameter>...`       | Qwen3-Coder, Qwen3.5         |
| `llama3_json` | the whole answer `{"name": ..., "parameters": {...}}` (`;` between)   | Llama 3.1-3.3                |
| `pythonic`    | the whole answer `[name(key=value, ...), ...]`                        | Llama 4, Gemma 3, ToolACE    |
| `mistral`     | `[TOOL_CALLS][{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`           | Mistral                      |
"""

from __future__ import annotations

import ast
import functools
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from .partial_json import (
    PartialCall,
    partial_json_call,
    partial_json_calls,
    partial_json_list,
    skip_whitespace,
    value_end,
)
from .text_deltas import before_marker
from .tool_calls import ToolCall, call_from_object, json_list, keep_raw_arguments


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes' format; Qwen2.5 / Qwen3 use it).
    The content is the text before the first block."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    arguments_keys = ("arguments", "parameters")

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, list[ToolCall]]:
        """(content, calls) of an answer; (text, []) when it holds no call that parses."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls, position = [], first
        while (position := text.find(self.start, position)) >= 0:
            close = text.find(self.end, position)
            body = text[position + len(self.start): close if close >= 0 else len(text)]
            try:
                call = call_from_object(json.loads(body), self.arguments_keys)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            written, _ = partial_json_call(body, skip_whitespace(body, 0), self.arguments_keys)
            calls += keep_raw_arguments([call], [written] if written else [])  # the arguments as written
            if close < 0:  # the answer ended (EOS) inside an otherwise whole block
                break
            position = close + len(self.end)
        return text[:first].rstrip(), calls

    def content_length(self, text: str) -> int:
        """How much of a growing answer is surely content (streamable): the text before a call's start, less any
        tail that could still be one, less trailing whitespace (the content is stripped before a call)."""
        return len(text[:before_marker(text, self.start)].rstrip())

    def partial_calls(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> list[PartialCall]:
        """The calls a growing answer has begun (inference/tool_call_stream.py): each block's object as far as it
        goes."""
        def next_block(end: int) -> int:  # the object after the next <tool_call> (-1: none yet)
            start = text.find(self.start, end)
            return -1 if start < 0 else skip_whitespace(text, start + len(self.start))

        return partial_json_calls(text, next_block(0), self.arguments_keys, next_block)


class Qwen3CoderParser:
    """Qwen3-Coder's and Qwen3.5's XML calls, one block per call:

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A value is the text between its tags (less the newline after the opening one and before the closing one, so code
    keeps its indentation); it is read as the type its parameter's schema in the request's tools names (`parse`'s
    `tools`): a string stays as written, other types (integer, number, boolean, null, object, array) are read as
    JSON, and a value that does not read as its type stays the string it is. The content is the text before the first
    block. Templates of this format also hold `<tool_call>`: `detect_parser` checks for this format first."""

    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    call = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>\s*)?", re.S)
    parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, list[ToolCall]]:
        first = min((i for i in (text.find(marker) for marker in self.markers) if i >= 0), default=-1)
        if first < 0:
            return text, []
        calls, position = [], first
        while position < len(text):
            match = self.call.match(text, position)
            if match is None:  # cut by max_tokens, or not this format
                return text, []
            name = match.group(1).strip()
            arguments = self._arguments(match.group(2), _properties(tools, name))
            if arguments is None:
                return text, []
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
            position = match.end()
        return text[:first].rstrip(), calls

    def _arguments(self, body: str, properties: dict[str, Any]) -> dict[str, Any] | None:
        """A function block's parameters as {name: value} (None: the block holds something else too)."""
        arguments, position = {}, 0
        for match in self.parameter.finditer(body):
            if body[position:match.start()].strip():
                return None
            key = match.group(1).strip()
            arguments[key] = parameter_value(match.group(2), properties.get(key))
            position = match.end()
        return None if body[position:].strip() else arguments

    def content_length(self, text: str) -> int:
        """The text before a block's start (or a tail that could still become one), less trailing whitespace."""
        return len(text[:min(before_marker(text, marker) for marker in self.markers)].rstrip())

    function_open, parameter_open = re.compile(r"<function=([^>\n]+)>"), re.compile(r"<parameter=([^>\n]+)>")

    def partial_calls(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> list[PartialCall]:
        """The calls a growing answer has begun (inference/tool_call_stream.py): a call once its function's name is
        whole, its arguments the start of the JSON `parse` will build from its parameters."""
        calls, position = [], 0
        while (match := self.function_open.search(text, position)) is not None:
            name, close = match.group(1).strip(), text.find("</function>", match.end())
            body = text[match.end(): close if close >= 0 else len(text)]
            calls.append(PartialCall(name, self._partial_arguments(body, _properties(tools, name))))
            if close < 0:
                break
            position = close + len("</function>")
        return calls

    def _partial_arguments(self, body: str, properties: dict[str, Any]) -> str:
        """The start of `json.dumps` of a function block's parameters that `body` (the block so far) fixes: each
        whole parameter; of the one being written, its key, and for a string its text less a tail that may be the
        closing tag (or the newline before it); never the closing brace (the whole answer's reading sends it)."""
        arguments, position = "{", 0
        while (match := self.parameter_open.search(body, position)) is not None:
            key, close = match.group(1).strip(), body.find("</parameter>", match.end())
            arguments += ("" if arguments == "{" else ", ") + json.dumps(key, ensure_ascii=False) + ": "
            value = body[match.end(): close if close >= 0 else len(body)]
            value = value[1:] if value.startswith("\n") else value  # as `parameter` reads it: one newline each side
            if close >= 0:
                value = value[:-1] if value.endswith("\n") else value
                arguments += json.dumps(parameter_value(value, properties.get(key)), ensure_ascii=False)
                position = close + len("</parameter>")
                continue
            if "string" in schema_types(properties.get(key)):  # escaped a character at a time: a prefix of the whole
                held = min(before_marker(value, "\n</parameter>"), before_marker(value, "</parameter>"))
                arguments += '"' + json.dumps(value[:held], ensure_ascii=False)[1:-1]
            break
        return arguments


def _properties(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The parameter schemas (`properties`) of the tool called `name` ({} if no tool has that name)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


JSON_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}


def schema_types(schema: dict[str, Any] | None) -> list[str]:
    """The JSON types a parameter's schema names ([]: any)."""
    types = (schema or {}).get("type")
    return [types] if isinstance(types, str) else list(types or [])


def parameter_value(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the type its JSON schema names: strings (and schemas allowing a string) as written; other
    types read as JSON when the text is that type; a schema without a type takes the text's JSON if it is JSON. Text
    that is not its type stays the string it is."""
    types = schema_types(schema)
    if "string" in types:
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if not types or any(JSON_TYPES.get(kind, lambda v: False)(value) for kind in types):
        return value
    return text


class Llama3JsonParser:
    """Llama 3.1-3.3's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"), several
    separated by `;`. An answer that is not wholly calls is content."""

    name = "llama3_json"
    tag = "<|python_tag|>"  # usually a special token (skipped in the text), but kept when written out
    arguments_keys = ("parameters", "arguments")

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.tag):].lstrip() if body.startswith(self.tag) else body
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            start = position
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = call_from_object(value, self.arguments_keys)
            if call is None:
                return text, []
            written, _ = partial_json_call(body, start, self.arguments_keys)
            calls += keep_raw_arguments([call], [written] if written else [])  # the arguments as written
            position = self._next_call(body, position)
        return ("", calls) if calls else (text, [])

    @staticmethod
    def _next_call(text: str, position: int) -> int:
        """Past the whitespace and `;` between two calls."""
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
        return position

    def partial_calls(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> list[PartialCall]:
        """The calls a growing answer has begun (inference/tool_call_stream.py): each object as far as it goes."""
        position = skip_whitespace(text, 0)
        if text.startswith(self.tag, position):
            position = skip_whitespace(text, position + len(self.tag))
        return partial_json_calls(text, position, self.arguments_keys, lambda end: self._next_call(text, end))

    def content_length(self, text: str) -> int:
        """An answer that opens like a call is held whole until it ends; any other streams as it comes."""
        opening = text.lstrip()
        if not opening or opening.startswith(("{", self.tag)) or self.tag.startswith(opening):
            return 0
        return len(text)


class PythonicParser:
    """Calls written as a Python list: the whole answer is `[get_weather(city="Paris"), clock()]` (Llama 4's and Llama
    3.2's pythonic templates, Gemma 3's function-calling prompt, ToolACE). Arguments are keywords whose values are
    Python literals (strings, numbers, True / False / None, lists, dicts), read without running anything
    (`ast.literal_eval`). Llama 4's `<|python_start|>` / `<|python_end|>` around the list are special tokens, skipped in
    the text or read when kept. An answer that is not wholly calls is content."""

    name = "pythonic"
    tags = ("<|python_start|>", "<|python_end|>")

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.tags[0]).removesuffix(self.tags[1]).strip()
        if not body.startswith("["):
            return text, []
        try:
            listed = ast.parse(body, mode="eval").body
        except SyntaxError:  # cut by max_tokens, or not Python
            return text, []
        if not isinstance(listed, ast.List) or not listed.elts:
            return text, []
        calls = []
        for node in listed.elts:
            if (not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute))
                    or any(keyword.arg is None for keyword in node.keywords)):  # positional or **arguments
                return text, []
            try:
                arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
                calls.append(ToolCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError):  # not a literal (a variable, an expression), or not JSON (a set)
                return text, []
        return "", calls

    def content_length(self, text: str) -> int:
        """An answer that opens like a list of calls is held whole until it ends; any other streams as it comes."""
        opening = text.lstrip()
        if not opening or opening.startswith(("[", self.tags[0])) or self.tags[0].startswith(opening):
            return 0
        return len(text)

    call_open = re.compile(r"\s*([A-Za-z_][\w.]*)\(")
    keyword = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*")

    def partial_calls(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> list[PartialCall]:
        """The calls a growing answer has begun (inference/tool_call_stream.py): a call once `name(` is written, its
        arguments the start of the JSON `parse` builds, a keyword at a time (once its value is whole)."""
        body = text.lstrip().removeprefix(self.tags[0]).lstrip()
        if not body.startswith("["):
            return []
        calls: list[PartialCall] = []
        position = 1
        while (match := self.call_open.match(body, position)) is not None:
            call = PartialCall(match.group(1), "{")
            calls.append(call)
            position = match.end()
            while (keyword := self.keyword.match(body, position)) is not None:
                end = python_value_end(body, keyword.end())
                written = None if end is None else literal_json(body[keyword.end():end])
                if written is None:
                    return calls
                key = json.dumps(keyword.group(1), ensure_ascii=False)
                call.arguments += ("" if call.arguments == "{" else ", ") + key + ": " + written
                position = skip_whitespace(body, end)
                if body.startswith(",", position):
                    position += 1
            position = skip_whitespace(body, position)
            if not body.startswith(")", position):
                return calls
            position = skip_whitespace(body, position + 1)
            if not body.startswith(",", position):
                return calls
            position += 1
        return calls


# a whole Python string literal (triple-quoted or not; the unrolled form), an opening quote that never closes, or a
# bracket or comma
PYTHON_STRUCTURE = re.compile(
    r"'''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''|\"\"\"[^\"\\]*(?:(?:\\.|\"(?!\"\"))[^\"\\]*)*\"\"\""
    r"|'[^'\\\n]*(?:\\.[^'\\\n]*)*'|\"[^\"\\\n]*(?:\\.[^\"\\\n]*)*\"|'''|\"\"\"|'|\"|[()\[\]{},]", re.S)


def python_value_end(text: str, start: int) -> int | None:
    """Where the Python literal starting at `start` ends: at the `,` or `)` after it outside brackets and strings
    (None: `text` ends first). Scans with a regular expression, as `partial_json.value_end` does."""
    depth = 0
    for match in PYTHON_STRUCTURE.finditer(text, start):
        token = match.group()
        if token in ("'", '"', "'''", '"""'):  # a string still being written
            return None
        if token[0] in "'\"":
            continue
        if token in "([{":
            depth += 1
        elif depth == 0:  # a comma or a closing bracket outside the value: it ends there
            return match.start() if match.start() > start else None
        elif token in ")]}":
            depth -= 1
    return None


@functools.lru_cache(maxsize=64)
def literal_json(text: str) -> str | None:
    """A Python literal's text as the JSON `parse` writes for it (None: not a literal, or not JSON), kept: a growing
    answer's whole keywords are read again with every piece."""
    try:
        return json.dumps(ast.literal_eval(text), ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


class MistralParser:
    """Mistral's calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). `[TOOL_CALLS]` and `[ARGS]` are special tokens, so the answer's
    text usually holds only the list, or the names each followed by their arguments; kept markers are read too. An
    answer that is not wholly calls is content. Call ids are 9 letters and digits, as Mistral's chat templates demand
    of the calls a client sends back."""

    name = "mistral"
    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    function_name = re.compile(r"[A-Za-z0-9_.\-]+")

    @staticmethod
    def new_call_id() -> str:
        """A call id as Mistral's chat templates demand of the calls a client sends back: 9 letters and digits."""
        return uuid.uuid4().hex[:9]

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, list[ToolCall]]:
        content, calls = self._parse(text)
        for call in calls:
            call.id = self.new_call_id()
        return content, calls

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.replace(self.marker, " ").strip()
        if body.startswith("["):  # a JSON list of calls
            calls = json_list(body)[1]
            return ("", calls) if calls else (text, [])
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):  # name[ARGS]{...} (the marker skipped in the text: name{...}), repeated
            match = self.function_name.match(body, position)
            if match is None:
                return text, []
            position = match.end()
            if body.startswith(self.args_marker, position):
                position += len(self.args_marker)
            start = position
            try:
                arguments, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(arguments, dict):
                return text, []
            calls.append(ToolCall(match.group(), body[start:position]))  # the arguments as written
            while position < len(body) and body[position].isspace():
                position += 1
        return ("", calls) if calls else (text, [])

    def content_length(self, text: str) -> int:
        """An answer that opens like a call (a list, or a name followed by `{` / `[ARGS]`) is held whole until it
        ends; any other streams as it comes."""
        opening = text.replace(self.marker, "").lstrip()
        if not opening or opening.startswith("["):
            return 0
        name = self.function_name.match(opening)
        rest = opening[name.end():] if name else opening
        if not rest or rest.startswith("{") or rest.startswith(self.args_marker) or self.args_marker.startswith(rest):
            return 0
        return len(text)

    def partial_calls(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> list[PartialCall]:
        """The calls a growing answer has begun (inference/tool_call_stream.py): the list's objects as far as they
        go, or each `name[ARGS]{...}` once its name is followed by its arguments."""
        body = text.replace(self.marker, " ")
        position = skip_whitespace(body, 0)
        if body.startswith("[", position):
            return partial_json_list(body, ("parameters", "arguments"))
        calls: list[PartialCall] = []
        while (match := self.function_name.match(body, position)) is not None:
            start = match.end() + (len(self.args_marker) if body.startswith(self.args_marker, match.end()) else 0)
            if not body.startswith("{", start):  # the name may still grow, or its [ARGS] is still being written
                break
            end = value_end(body, start)
            calls.append(PartialCall(match.group(), body[start:len(body) if end is None else end]))
            if end is None:
                break
            position = skip_whitespace(body, end)
        return calls


PARSERS = {parser.name: parser for parser in (HermesParser, Qwen3CoderParser, Llama3JsonParser, PythonicParser,
                                                MistralParser)}
ToolParser = HermesParser | Qwen3CoderParser | Llama3JsonParser | PythonicParser | MistralParser


def make_parser(name: str) -> ToolParser:
    """The parser called `name` (one of `PARSERS`)."""
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r}: expected one of {', '.join(PARSERS)}")
    return PARSERS[name]()


def detect_parser(chat_template: str | None) -> str | None:
    """The parser for the call format a chat template teaches (None: it shows none we know)."""
    if not chat_template:
        return None
    if "<function=" in chat_template and "<parameter=" in chat_template:  # before hermes: these hold <tool_call> too
        return Qwen3CoderParser.name
    if HermesParser.start in chat_template:
        return HermesParser.name
    if MistralParser.marker in chat_template:
        return MistralParser.name
    if "func_name1(" in chat_template or PythonicParser.tags[0] in chat_template:  # the pythonic prompts' example
        return PythonicParser.name
    if Llama3JsonParser.tag in chat_template or '"parameters"' in chat_template:
        return Llama3JsonParser.name
    return None
