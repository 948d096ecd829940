"""A chat answer read into its parts (reasoning, content, tool calls), whole or while it streams.

The target writes one text; a chat answer returns it as `reasoning_content` (a think block, inference/reasoning.py),
`content` and `tool_calls` (inference/tool_calls.py). Streamed, each piece of text is sent as reasoning or content
only once it is sure to be that (a tail that may still become `</think>` or a call's start waits), so the pieces sent,
plus what is left at the end, join to the parts of the whole answer; calls are sent as they are written
(inference/tool_call_stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ThinkParser
from .tool_call_stream import CallDelta, CallStream
from .tool_calls import ToolCall, ToolRequest, new_call_id
from .tool_parsers import ToolParser


@dataclass
class Parts:
    """An answer's parts: `reasoning` (None: no think block), `content`, `calls`; and, streamed, what of the
    reasoning and the content was not sent yet."""

    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    unsent_reasoning: str = ""
    unsent_content: str = ""
    unsent_calls: list[CallDelta] = field(default_factory=list)  # streamed: what finishes the calls sent


class AnswerParts:
    """Reads one answer's parts.

    Args:
        tools: the request's tools (None: no calls are read).
        tool_parser: reads an "auto" answer's calls.
        reasoning_parser: splits off the think block (None: the whole answer is content).
        opened: the prompt left the answer inside a think block (`ThinkParser.opens_in_prompt`).
    """

    def __init__(self, tools: ToolRequest | None = None, tool_parser: ToolParser | None = None,
                 reasoning_parser: ThinkParser | None = None, opened: bool = False) -> None:
        self.tools, self.tool_parser = tools, tool_parser
        self.reasoning_parser, self.opened = reasoning_parser, opened
        self.text = ""  # the answer so far
        self.sent_reasoning = 0  # characters of the reasoning sent
        self.sent_content = 0  # characters of the content sent
        self.stream = CallStream(getattr(tool_parser, "new_call_id", new_call_id))  # the calls sent as written
        self.call_deltas: list[CallDelta] = []  # made by `feed`, not yet taken (`take_calls`)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning_parser is None:
            return "", text
        return self.reasoning_parser.split(text, self.opened, final)

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) to send now, given the answer's next piece."""
        self.text += piece
        reasoning, content = self._split(self.text, final=False)
        if self.tools is not None:
            self.call_deltas += self.stream.update(self.tools.partial_calls(content, self.tool_parser))
            content = self._content_before_calls(content)
        new = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = max(self.sent_reasoning, len(reasoning)), max(self.sent_content,
                                                                                                len(content))
        return new

    def _content_before_calls(self, content: str) -> str:
        """What of `content` is surely text, not calls (streamed as content)."""
        if self.tools is None or not self.tools.parses_calls:
            return content
        return "" if self.tools.forced else content[:self.tool_parser.content_length(content)]

    def reasoning_length(self, text: str) -> int:
        """Characters of the whole answer `text` its reasoning block takes, tags included (0: none)."""
        return 0 if self.reasoning_parser is None else self.reasoning_parser.block_length(text, self.opened)

    def take_calls(self) -> list[CallDelta]:
        """The call pieces the last `feed`s made (inference/tool_call_stream.py), once."""
        deltas, self.call_deltas = self.call_deltas, []
        return deltas

    def finish(self, text: str) -> Parts:
        """The parts of the whole answer `text` (what `feed` got, when streamed), with what was not sent; calls that
        were streamed and that the whole text does not read as stay as they were sent (`tool_call_stream`)."""
        reasoning, written = self._split(text, final=True)
        content, calls = (written, []) if self.tools is None else self.tools.read_calls(written, self.tool_parser)
        if self.stream.agrees(calls):
            unsent_calls = self.stream.complete(calls)
        else:  # streamed calls the whole text does not read as (cut, malformed): kept as far as they went
            unsent_calls = self.stream.update(self.tools.partial_calls(written, self.tool_parser))
            content, calls = self._content_before_calls(written), self.stream.calls()
        has_reasoning = self.reasoning_parser is not None and (self.opened or text.lstrip().startswith(
            self.reasoning_parser.start))
        return Parts(reasoning if has_reasoning else None, content, calls, reasoning[self.sent_reasoning:],
                     content[self.sent_content:], self.take_calls() + unsent_calls)
