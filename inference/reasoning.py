"""Reasoning in a chat answer: the `<think>...</think>` block of reasoning models, split off the answer's content.

Qwen3, QwQ and DeepSeek-R1 write their reasoning between `<think>` and `</think>` before the answer proper. The
server returns it as the message's `reasoning_content` (DeepSeek's and vLLM's field) and the rest as `content`, so a
client shows (or drops) the reasoning and reads tool calls out of the answer only. Two ways a block opens: the model
writes `<think>` first (Qwen3), or the chat template's generation prompt already ends with it (DeepSeek-R1, QwQ), so
the answer starts inside the block and only `</think>` appears (an opener the model writes again is dropped). A block never closed (the answer was cut by
`max_tokens`) is all reasoning. Nothing is generated differently: this is how the target's own text is read.
"""

from __future__ import annotations

from .text_deltas import before_marker


class ThinkParser:
    """Splits `<think>reasoning</think>content` answers."""

    name = "think"
    start, end = "<think>", "</think>"

    def opens_in_prompt(self, prompt_text: str) -> bool:
        """Whether a prompt (its text, special tokens kept) leaves the answer inside a reasoning block: its
        generation prompt ends with `<think>`."""
        return prompt_text.rstrip().endswith(self.start)

    def split(self, text: str, opened: bool, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of an answer's `text` (`opened`: the prompt opened the block). Not `final` (the
        answer still growing): the parts that are sure so far, each a prefix of the final one, holding back a tail
        that may still be the block's start or end, and whitespace the final parts strip."""
        stripped = text.lstrip()
        if not final and self.start.startswith(stripped):  # may still open a block (or repeat the prompt's opener)
            return "", ""
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif opened:
            body = text
        else:
            return "", text  # no reasoning: all content
        close = body.find(self.end)
        if close >= 0:
            return body[:close].strip(), body[close + len(self.end):].lstrip()
        if final:
            return body.strip(), ""
        return body[:before_marker(body, self.end)].strip(), ""

    def block_length(self, text: str, opened: bool) -> int:
        """How many characters of a whole answer `text` its reasoning block takes (through `</think>`; all of them for
        a block never closed; 0 without one): what the answer's reasoning tokens spell (`usage.reasoning_tokens`)."""
        stripped = text.lstrip()
        if not stripped.startswith(self.start) and not opened:
            return 0
        close = text.find(self.end)
        return len(text) if close < 0 else close + len(self.end)


REASONING_PARSERS = {ThinkParser.name: ThinkParser}


def make_reasoning_parser(name: str) -> ThinkParser:
    """The reasoning parser called `name` (one of `REASONING_PARSERS`)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r}: expected one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning parser for a chat template that knows think blocks (None: it shows none)."""
    return ThinkParser.name if chat_template and ThinkParser.end in chat_template else None

