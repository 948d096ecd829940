"""Tool calls in the OpenAI API: a request's tools go to the chat template, the calls come out of the answer's text.

A chat request's `tools` reach the target's chat template, which writes them into the prompt in the model's own
format, and its messages may hold earlier calls (an assistant's `tool_calls`) and their results (`tool` messages).
What the answer does with them follows `tool_choice`:

- "auto" (the default with tools): the target answers freely; a *parser* for the model's call format reads the calls
  out of the answer's text (inference/tool_parsers.py: hermes, qwen3_coder, llama3_json, pythonic, mistral; picked
  from the chat template by `detect_parser`).
- "required" or a named function: the answer is constrained to JSON by the tools' parameter schemas (a list of
  `{"name", "parameters"}`, or the named function's arguments), as vLLM does, so any template and model work.
- "none": the tools are shown to the model, and its answer is text.

Either way the answer is the target's own text (greedy: `target.generate`'s, under the same constraint for the forced
choices); the calls are read from it, never repaired: an answer whose calls do not parse is returned as text. JSON
arguments are returned as the model wrote them. Streamed, calls are sent as they are written
(inference/tool_call_stream.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .partial_json import PartialCall, partial_json_list

if TYPE_CHECKING:
    from .tool_parsers import ToolParser

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


def call_from_object(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
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
                json.loads(text)
            except json.JSONDecodeError:  # cut by max_tokens
                return text, []
            return "", [ToolCall(self.function, text)]  # the arguments as written (as they were streamed)
        if self.choice == "required":
            return json_list(text)
        content, calls = parser.parse(text, self.tools)
        return content, calls if self.parallel else calls[:1]

    def partial_calls(self, text: str, parser: ToolParser | None) -> list[PartialCall]:
        """The calls an answer's text so far has begun, each with the part of its arguments the text fixes
        (inference/tool_call_stream.py); [] for a parser that cannot read calls before they end."""
        if not self.parses_calls:
            return []
        if self.choice == "function":
            return [PartialCall(self.function, text)]
        if self.choice == "required":
            return partial_json_list(text, ("parameters", "arguments"))
        partial_calls = getattr(parser, "partial_calls", None)
        calls = [] if partial_calls is None else partial_calls(text, self.tools)
        return calls if self.parallel else calls[:1]


def json_list(text: str) -> tuple[str, list[ToolCall]]:
    """The calls of a JSON list of {"name", "parameters" (or "arguments")}: a "required" answer's, Mistral's."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError:  # cut by max_tokens
        return text, []
    if not isinstance(values, list):
        return text, []
    calls = [call_from_object(value, ("parameters", "arguments")) for value in values]
    if not calls or None in calls:
        return text, []
    return "", keep_raw_arguments(calls, partial_json_list(text, ("parameters", "arguments")))


def keep_raw_arguments(calls: list[ToolCall], partial: list[PartialCall]) -> list[ToolCall]:
    """`calls` read from whole JSON, each with its arguments as the model wrote them (`partial`'s reading of the same
    text) where those are the same JSON: what a stream of the answer sent is then the start of each call's arguments."""
    for call, written in zip(calls, partial):
        try:
            same = call.name == written.name and json.loads(written.arguments) == json.loads(call.arguments)
        except json.JSONDecodeError:
            same = False
        if same:
            call.arguments = written.arguments
    return calls


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
