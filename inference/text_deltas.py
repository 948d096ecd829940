"""A `generate` streamer that turns new tokens into text pieces and cuts the text before the first stop string.

`generate(stop_strings=...)` ends a row right after its text contains a stop string, as transformers does, and keeps
the stop string in the output. An API answer leaves it out (OpenAI's `stop`), and a streamed one must not send any
part of it before it is known not to be one: `TextDeltas` holds back the end of the text while it could still
become a stop string, and text ending in an incomplete multi-byte character (decoded as U+FFFD) until the character
is whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase


class TextDeltas:
    """Streamer (`put` / `end`, as transformers' streamers) of one row's new text.

    Args:
        tokenizer: decodes the new tokens (special tokens skipped).
        stop: stop strings; the text ends before the first one found.
        on_text: called with each new piece of text as soon as it is safe to send (None: only collect).

    After `end()`: `text` is the whole answer (the pieces joined) and `stopped` whether a stop string ended it.
    While streaming, `covered` is how many of the new tokens the text sent so far is made of (the fewest whose text
    covers it: a token whose text is held back, a stop string's, a trailing EOS are not counted yet), so that a
    server can send each token's log-probability with the piece that holds its text.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.on_text = on_text
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.covered = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        """The prompt first (skipped, as transformers' `skip_prompt`), then each round's new tokens."""
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.ids += value.flatten().tolist()
        self._advance(final=False)

    def end(self) -> None:
        """Generation finished: send what was held back."""
        self._advance(final=True)

    def _advance(self, final: bool) -> None:
        if self.stopped:
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            text, self.stopped = text[: min(found)], True
        elif not final:
            text = text.rstrip("\ufffd")  # a multi-byte character still incomplete
            text = text[: len(text) - marker_tail(text, self.stop)]  # a tail that may still become a stop string
        if self.on_text is None:  # nothing sent yet: the text may still change anywhere
            self.text = text
        elif len(text) > len(self.text) and text.startswith(self.text):  # what was sent stays (prefix-stable decode)
            piece, self.text = text[len(self.text):], text
            self.covered = self._covering(len(text))
            self.on_text(piece)

    def _covering(self, length: int) -> int:
        """The fewest new tokens whose text is at least `length` characters long (few decodes: from the end)."""
        count = len(self.ids)
        while count and len(self.tokenizer.decode(self.ids[: count - 1], skip_special_tokens=True)) >= length:
            count -= 1
        return count


def marker_tail(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that is the start of one of `markers` (it may still become one)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def before_marker(text: str, marker: str) -> int:
    """Where `text` stops being surely free of `marker`: at `marker`, or at a tail that could still grow into it."""
    found = text.find(marker)
    return found if found >= 0 else len(text) - marker_tail(text, [marker])
