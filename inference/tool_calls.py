"""Tool calls in the OpenAI API: a request's tools go to the chat template, the calls come out of the answer's text.

A chat request's `tools` reach the target's chat template, which writes them into the prompt in the model's own
format, and its messages may hold earlier calls (an assistant's `tool_calls`) and their results (`tool` messages).
What the answer does with them follows `tool_choice`:

- "auto" (the default with tools): the target answers freely; a *parser* for the model's call format reads the calls
  out of the answer's text. "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3,
  Hermes, SmolLM3); "llama3_json": the whole answer `{"name": ..., "parameters": {...}}`, several joined by `;`
  (Llama 3.1-3.3; their `<|python_tag|>` is a special token, skipped in the text); "mistral": `[TOOL_CALLS]` then a
  JSON list of calls, or (newer tokenizers) `name[ARGS]{...}` per call (the bracketed markers are special tokens,
  skipped in the text). `detect_parser` picks one from the chat template.
- "required" or a named function: the answer is constrained to JSON by the tools' parameter schemas (a list of
  `{"name", "parameters"}`, or the named function's arguments), as vLLM does, so any template and model work.
- "none": the tools are shown to the model, and its answer is text.

Either way the answer is the target's own text (greedy: `target.generate`'s, under the same constraint for the forced
choices); the calls are read from it, never repaired: an answer whose calls do not parse is returned as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .text_deltas import before_marker

EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function taking nothing


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One call of a function: its name and its arguments as a JSON string (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def body(self, index: int | None = None) -> dict[str, Any]:
        """The call as an answer's `tool_calls` entry (a streamed delta's carries its `index`)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def _call_from_object(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """The call a decoded JSON object names ({"name": ..., <arguments key>: {...}}), or None if it names none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if isinstance(arguments, str):  # already a JSON string: keep it if it is JSON
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return ToolCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes' format; Qwen2.5 / Qwen3 use it).
    The content is the text before the first block."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of an answer; (text, []) when it holds no call that parses."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls, position = [], first
        while (position := text.find(self.start, position)) >= 0:
            close = text.find(self.end, position)
            body = text[position + len(self.start): close if close >= 0 else len(text)]
            try:
                call = _call_from_object(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
            if close < 0:  # the answer ended (EOS) inside an otherwise whole block
                break
            position = close + len(self.end)
        return text[:first].rstrip(), calls

    def content_length(self, text: str) -> int:
        """How much of a growing answer is surely content (streamable): the text before a call's start, less any
        tail that could still be one, less trailing whitespace (the content is stripped before a call)."""
        return len(text[:before_marker(text, self.start)].rstrip())


class Llama3JsonParser:
    """Llama 3.1-3.3's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"), several
    separated by `;`. An answer that is not wholly calls is content."""

    name = "llama3_json"
    tag = "<|python_tag|>"  # usually a special token (skipped in the text), but kept when written out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.tag):].lstrip() if body.startswith(self.tag) else body
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call_from_object(value, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return ("", calls) if calls else (text, [])

    def content_length(self, text: str) -> int:
        """An answer that opens like a call is held whole until it ends; any other streams as it comes."""
        opening = text.lstrip()
        if not opening or opening.startswith(("{", self.tag)) or self.tag.startswith(opening):
            return 0
        return len(text)


class MistralParser:
    """Mistral's calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). `[TOOL_CALLS]` and `[ARGS]` are special tokens, so the answer's
    text usually holds only the list, or the names each followed by their arguments; kept markers are read too. An
    answer that is not wholly calls is content. Call ids are 9 letters and digits, as Mistral's chat templates demand
    of the calls a client sends back."""

    name = "mistral"
    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    function_name = re.compile(r"[A-Za-z0-9_.\-]+")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls = self._parse(text)
        for call in calls:
            call.id = uuid.uuid4().hex[:9]
        return content, calls

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.replace(self.marker, " ").strip()
        if body.startswith("["):  # a JSON list of calls
            calls = _json_list(body)[1]
            return ("", calls) if calls else (text, [])
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):  # name[ARGS]{...} (the marker skipped in the text: name{...}), repeated
            match = self.function_name.match(body, position)
            if match is None:
                return text, []
            position = match.end()
            if body.startswith(self.args_marker, position):
                position += len(self.args_marker)
            try:
                arguments, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(arguments, dict):
                return text, []
            calls.append(ToolCall(match.group(), json.dumps(arguments, ensure_ascii=False)))
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


PARSERS = {parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)}
ToolParser = HermesParser | Llama3JsonParser | MistralParser


def make_parser(name: str) -> ToolParser:
    """The parser called `name` (one of `PARSERS`)."""
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r}: expected one of {', '.join(PARSERS)}")
    return PARSERS[name]()


def detect_parser(chat_template: str | None) -> str | None:
    """The parser for the call format a chat template teaches (None: it shows none we know)."""
    if not chat_template:
        return None
    if HermesParser.start in chat_template:
        return HermesParser.name
    if MistralParser.marker in chat_template:
        return MistralParser.name
    if Llama3JsonParser.tag in chat_template or '"parameters"' in chat_template:
        return Llama3JsonParser.name
    return None


@dataclass
class ToolRequest:
    """A request's tools and what its answer may do with them.

    Attributes:
        tools: the request's `tools` ({"type": "function", "function": {"name", "description", "parameters"}}).
        choice: "none", "auto", "required", or "function" (the one named in `function` must be called).
        function: the function a named `tool_choice` forces.
        parallel: whether the answer may hold several calls (`parallel_tool_calls`).
    """

    tools: list[dict[str, Any]]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """The answer must be calls: it is constrained to their JSON (`schema`)."""
        return self.choice in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or EMPTY_PARAMETERS

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced answer is constrained to (None unless forced): the named function's arguments,
        or a list of at least one (at most one unless parallel) `{"name", "parameters"}` of the tools."""
        if self.choice == "function":
            return self.parameters(self.function)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                    "parameters": self.parameters(t["function"]["name"])},
                  "required": ["name", "parameters"]} for t in self.tools]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}

    def read_calls(self, text: str, parser: ToolParser | None) -> tuple[str, list[ToolCall]]:
        """(content, calls) of an answer's text. A forced answer is the calls' JSON; an "auto" one is read by
        `parser`. Text that holds no call that parses is all content."""
        if not self.parses_calls:
            return text, []
        if self.choice == "function":
            try:
                return ("", [ToolCall(self.function, json.dumps(json.loads(text), ensure_ascii=False))])
            except json.JSONDecodeError:  # cut by max_tokens
                return text, []
        if self.choice == "required":
            return _json_list(text)
        content, calls = parser.parse(text)
        return content, calls if self.parallel else calls[:1]


def _json_list(text: str) -> tuple[str, list[ToolCall]]:
    """The calls of a JSON list of {"name", "parameters" (or "arguments")}: a "required" answer's, Mistral's."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError:  # cut by max_tokens
        return text, []
    if not isinstance(values, list):
        return text, []
    calls = [_call_from_object(value, ("parameters", "arguments")) for value in values]
    return ("", calls) if calls and None not in calls else (text, [])


class ToolRequestError(ValueError):
    """A request's tools fields that cannot be read: `param` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The `ToolRequest` of a chat request body (None without tools); a `ToolRequestError` names a bad field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise ToolRequestError("tool_choice", f"tool_choice={choice!r} needs tools (the request has none)")
        return None
    if not isinstance(tools, list):
        raise ToolRequestError("tools", f"tools={tools!r}: expected a list of {{'type': 'function', 'function': "
                                        "{...}}")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolRequestError("tools", f"tools[{i}]={tool!r}: expected {{'type': 'function', 'function': "
                                            "{'name': ..., 'parameters': {...}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolRequestError("tools", f"tools[{i}].function.name={function.get('name')!r}: expected a non-empty "
                                            "string")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolRequestError("tools", f"tools[{i}].function.parameters={function['parameters']!r}: expected a "
                                            "JSON schema object")
        names.append(function["name"])
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls", f"parallel_tool_calls={parallel!r}: expected true or false")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tools, choice or "auto", parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or named not in names:
        raise ToolRequestError("tool_choice", f"tool_choice={choice!r}: expected 'none', 'auto', 'required' or "
                               f"{{'type': 'function', 'function': {{'name': ...}}}} naming one of the tools "
                               f"({', '.join(names)})")
    return ToolRequest(tools, "function", named, parallel)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as chat templates take it: an assistant's `tool_calls` with their arguments as objects
    (templates write `arguments | tojson`; the wire carries JSON strings), a tool result's `tool_call_id` / `name`."""
    converted = {key: message[key] for key in ("tool_call_id", "name") if message.get(key) is not None}
    calls = message.get("tool_calls")
    if calls:
        converted["tool_calls"] = []
        for call in calls:
            function = dict(call.get("function") or {})
            try:
                arguments = function.get("arguments")
                function["arguments"] = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                pass  # a template that writes the string as it is still renders it
            converted["tool_calls"].append({**call, "function": function})
    return converted
