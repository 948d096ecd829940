"""Tool calls streamed as they are written: each call's name, then its arguments piece by piece (OpenAI's stream form).

A streamed chat answer sends each call as soon as its name is known (a delta with the call's `id`, `type` and
`function.name`), then the new part of its `function.arguments` with each piece of text; clients join the pieces.
Agent clients show a long call (a file's content, a shell command) while it is written instead of after a silence.

What is sent must be part of the final answer's arguments, so a partial reader gives, for the answer's text so far,
each call begun (`PartialCall`): its name and the prefix of its arguments that the text already fixes. The formats:

- JSON (hermes blocks, llama3_json answers, `tool_choice` "required" and a named function): the arguments are the
  JSON as the model wrote it (whole answers return the same text), streamed as it grows; the partial reading is
  inference/partial_json.py.
- Qwen3-Coder XML: the arguments are built as `json.dumps` of the parameters; a string parameter is streamed as it
  grows (escaped character by character, less a tail that may be its closing tag), other types once their tag closes.
- Mistral's JSON list or `name[ARGS]{...}` calls: the JSON as written, as the others.
- Pythonic calls: the JSON `parse` builds from the keywords, a keyword at a time once its value (a Python literal)
  is whole.

`CallStream` keeps what was sent and makes the deltas. At the end the whole answer's calls are checked against what
was streamed (`agrees`): when each begins with what was sent, the rest follows (`complete`: usually the closing brace);
when the text did not read as calls after all (cut by max_tokens, or malformed), the answer's calls are the streamed
ones as far as they went: a call whose name and arguments were sent is not taken back, as OpenAI's streams end a call
cut by max_tokens. (Unstreamed answers keep the whole-answer rule: calls that do not parse are text.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .partial_json import PartialCall
from .tool_calls import ToolCall, new_call_id


@dataclass
class CallDelta:
    """One streamed piece of call `index`: the first carries its id and name, the others only argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def body(self) -> dict[str, Any]:
        """The piece as a chat chunk's `delta.tool_calls` entry."""
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is None:
            return {"index": self.index, "function": function}
        return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, **function}}


@dataclass
class CallStream:
    """What of an answer's calls was streamed, and the deltas that bring a client up to date."""

    new_id: Callable[[], str] = new_call_id  # a call's id (the tool parser's `new_call_id` where it has one)
    sent: list[ToolCall] = field(default_factory=list)  # per call: its id, name and the arguments sent

    def update(self, partial: list[PartialCall]) -> list[CallDelta]:
        """The deltas from what was sent to the calls `partial` reads (each one's arguments only grow)."""
        deltas = []
        for index, call in enumerate(partial):
            if index == len(self.sent):
                self.sent.append(ToolCall(call.name, call.arguments, self.new_id()))
                deltas.append(CallDelta(index, call.arguments, self.sent[index].id, call.name))
            elif len(call.arguments) > len(self.sent[index].arguments) and call.arguments.startswith(
                    self.sent[index].arguments):  # (a reading that is not the sent text grown waits for the end)
                deltas.append(CallDelta(index, call.arguments[len(self.sent[index].arguments):]))
                self.sent[index].arguments = call.arguments
        return deltas

    def agrees(self, calls: list[ToolCall]) -> bool:
        """Whether the whole answer's `calls` begin with what was streamed (each its name and its arguments so far)."""
        return len(calls) >= len(self.sent) and all(
            call.name == sent.name and call.arguments.startswith(sent.arguments) for call, sent in zip(calls, self.sent))

    def complete(self, calls: list[ToolCall]) -> list[CallDelta]:
        """The deltas that finish the streamed calls as the whole answer's `calls` (which `agrees`), and send the
        calls not streamed yet whole; `calls` get the streamed calls' ids, and new ones for the others."""
        deltas = []
        for index, call in enumerate(calls):
            if index < len(self.sent):
                call.id, rest = self.sent[index].id, call.arguments[len(self.sent[index].arguments):]
                if rest:
                    deltas.append(CallDelta(index, rest))
            else:
                call.id = self.new_id()
                deltas.append(CallDelta(index, call.arguments, call.id, call.name))
        self.sent = [ToolCall(call.name, call.arguments, call.id) for call in calls]
        return deltas

    def calls(self) -> list[ToolCall]:
        """The calls as streamed so far."""
        return [ToolCall(sent.name, sent.arguments, sent.id) for sent in self.sent]
