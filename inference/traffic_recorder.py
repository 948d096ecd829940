"""Served answers kept as training data (`specheads serve --record FILE`).

Heads accept most where they were trained on what they will draft: this server's own traffic, answered by this
target. Every answered chat request (`/v1/chat/completions`, `/v1/responses`; streamed or whole) is appended to a
JSONL file as one OpenAI-format record per distinct answer (greedy choices are one answer, sampled ones each their
own): the request's messages, then the answer as the assistant's turn (`content`, its `reasoning_content` and
`tool_calls` when it has them), and the request's `tools`, the form `specheads train data.source=FILE` (and `data
regenerate`) read. `finish_reason` says whether an answer was cut by `max_tokens` ("length").

`/v1/completions` answers are appended as prompt-completion records (`{"prompt", "completion"}`, each distinct answer
once, the prompt as the server decoded it), the data format `completion`: the completion trained after its prompt as
raw text, as the server answered it (no chat template).

Left out, and counted: requests whose messages hold images (their base64 parts are no training record; train
vision-language heads on image files). Prompts and answers are written as they came: the file holds users' text.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

RECORDER_COUNTERS = {  # the server's /metrics counters of a recording (`CompletionService.metrics`)
    "recorded_answers": "answers written to the --record file as training records (conversations, prompt-completions)",
    "unrecorded_requests": "answered chat requests left out of the --record file (their messages hold images)",
}


def answer_message(text: str, reasoning: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """An answer as the assistant's turn of a training conversation (content None: it only calls tools)."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def holds_images(messages: list[dict[str, Any]]) -> bool:
    """Whether any message's content has a part other than text (an `image_url`)."""
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") != "text"
                                                          for p in m["content"]) for m in messages)


class TrafficRecorder:
    """Appends served chat answers to `path` as training conversations; safe to call from several threads.

    Attributes:
        recorded: records written since the server started.
        skipped: answered requests left out (their messages hold images).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.recorded = self.skipped = 0

    def record(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               answers: list[tuple[str, str | None, list[dict[str, Any]], str]]) -> None:
        """Append one record per answer: (content, reasoning or None, tool_calls as message entries, finish_reason).

        The lines of one request go out in one write, under the lock: concurrent requests never interleave.
        """
        if holds_images(messages):
            with self._lock:
                self.skipped += 1
            return
        lines = []
        for text, reasoning, calls, finish_reason in answers:
            record: dict[str, Any] = {"id": f"served-{uuid.uuid4().hex[:16]}",
                                      "messages": [*messages, answer_message(text, reasoning, calls)]}
            if tools:
                record["tools"] = tools
            record["finish_reason"] = finish_reason
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        self._append(lines)

    def record_completion(self, prompt: str, answers: list[tuple[str, str]]) -> None:
        """Append one prompt-completion record per answer of a `/v1/completions` request: (text, finish_reason)."""
        self._append([json.dumps({"id": f"served-{uuid.uuid4().hex[:16]}", "prompt": prompt, "completion": text,
                                  "finish_reason": reason}, ensure_ascii=False) + "\n" for text, reason in answers])

    def _append(self, lines: list[str]) -> None:
        """Write one request's lines in one write, under the lock (concurrent requests never interleave)."""
        with self._lock, self.path.open("a", encoding="utf-8") as out:
            out.write("".join(lines))
            self.recorded += len(lines)
