"""Conversations -> token ids and a loss mask: the chat template, turn by turn.

A ShareGPT or OpenAI record becomes {"role", "content"} messages (`to_messages`); the target's chat template renders
them, and each assistant turn is cut out of the rendering (`conversation_spans`) so that only the answers are
trained: `loss_mask[i] == 1` means "predicting token i is trained". Without a chat template the layout is
"role: text" lines. The chat template's keywords (`enable_thinking`, ...) are those the target is prompted with at
inference. A template that renders earlier turns otherwise once later ones follow (Qwen3 drops their reasoning) is
trained one assistant turn per example, each after exactly the prompt the target answers it after
(`tokenized_examples`).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import PreTrainedTokenizerBase

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
                  # LLaMA-Factory's ShareGPT: a function call is the assistant's turn, its result the tool's
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
# fields of an OpenAI message the chat templates that know them render: a reasoning model's thoughts (vLLM's and
# DeepSeek's API field), an assistant's tool calls, a tool result's call id and name
MESSAGE_FIELDS = ("reasoning_content", "tool_calls", "tool_call_id", "name")


def to_messages(record: dict[str, Any], fmt: str) -> list[dict[str, Any]]:
    """A ShareGPT or OpenAI record as a list of {"role", "content"} messages; a turn's `MESSAGE_FIELDS`
    (`reasoning_content`, `tool_calls`, ...) are kept for the chat templates that render them (Qwen3's, ...). A plain
    prompt-completion record reads as the user's prompt and the assistant's completion."""
    if fmt == "completion":
        return [{"role": "user", "content": str(record.get("prompt") or "")},
                {"role": "assistant", "content": str(record["completion"])}]
    if fmt == "sharegpt":
        messages = []
        for turn in record["conversations"]:
            speaker = str(turn.get("from", "")).lower()
            if speaker not in SHAREGPT_ROLES:
                raise ValueError(f"ShareGPT turn has unknown speaker from={turn.get('from')!r}; "
                                 f"expected one of {sorted(SHAREGPT_ROLES)}")
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": str(turn.get("value", "")),
                             **_message_fields(turn)})
        return messages
    return [{"role": str(m["role"]), "content": message_text(m.get("content")), **_message_fields(m)}
            for m in record["messages"]]


def unprompted_answers(messages: list[dict[str, Any]]) -> int:
    """How many assistant turns come before the first user turn (ShareGPT's split conversations often open with one):
    no prompt precedes them for a chat template to render, nor for the target to have answered."""
    return sum(m["role"] == "assistant" for m in messages[: _first_user_turn(messages)])


def prompted_messages(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` without the assistant turns before the first user turn when a chat template renders them (it
    cannot render an answer to nothing; `data regenerate` leaves those out too); as they are without a template."""
    if not tokenizer.chat_template:
        return messages
    first_user = _first_user_turn(messages)
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]


def _first_user_turn(messages: list[dict[str, Any]]) -> int:
    """Index of the first user message (len(messages) when there is none)."""
    return next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))


def _message_fields(turn: dict[str, Any]) -> dict[str, Any]:
    return {name: turn[name] for name in MESSAGE_FIELDS if turn.get(name)}


def record_template_kwargs(record: dict[str, Any], template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's keywords for one record: the run's, plus the record's `tools` (the functions its
    conversation may call, which tool-calling templates describe in the prompt)."""
    return {**(template_kwargs or {}), **({"tools": record["tools"]} if record.get("tools") else {})}


def unrendered_fields(tokenizer: Any, records: list[dict[str, Any]], fmt: str) -> dict[str, int]:
    """{field: how many records hold it} for the `MESSAGE_FIELDS` and record `tools` that the tokenizer's chat
    template never mentions (so never renders: what they hold would go untrained)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    counts: dict[str, int] = {}
    for record in records:
        present = {name for message in to_messages(record, fmt) for name in MESSAGE_FIELDS if name in message}
        present |= {"tools"} if record.get("tools") else set()
        for name in present:
            if name not in template:
                counts[name] = counts.get(name, 0) + 1
    return counts


def message_text(content: Any) -> str:
    """A message's text: the string itself, or the text parts of a list of content parts (`{"type": "text",
    "text": ...}`) joined; other parts (images) are left out."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text")
    return "" if content is None else str(content)  # None: an assistant turn that only calls tools


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, template_kwargs: dict[str, Any] | None = None
) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **(template_kwargs or {}))


class NotIncrementalTemplate(ValueError):
    """The chat template renders a conversation's earlier turns otherwise once later turns follow (Qwen3's drops
    their reasoning), so a turn's text cannot be cut out of the whole conversation's."""


def conversation_segments(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
) -> list[tuple[str, bool]]:
    """Cut a conversation into (text, is_assistant) pieces whose concatenation is the rendered conversation.

    With a chat template: the text of assistant turn i is what rendering messages[: i + 1] adds after
    rendering messages[:i] with the generation prompt. Without one: "role: text" lines, with the answer
    and an end-of-sequence token trained. `template_kwargs`: the chat template's keywords (`enable_thinking`, ...).

    Raises:
        NotIncrementalTemplate: the template renders earlier turns otherwise once later ones follow.
    """
    return [(text, trained) for text, trained, _ in conversation_spans(tokenizer, messages, template_kwargs)]


def conversation_spans(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
) -> list[tuple[str, bool, range]]:
    """`conversation_segments` with, for each piece, the range of `messages` whose content it writes (a piece that
    is only a role marker or the template's tail writes none). `tokenizer` is a tokenizer, or a processor with a
    chat template (messages whose contents are lists of parts: vision-language records)."""
    spans: list[tuple[str, bool, range]] = []
    if tokenizer.chat_template:
        done, first = "", 0  # the rendered text so far; the first message it does not cover yet
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = _render(tokenizer, messages[:i], True, template_kwargs)
                full = _render(tokenizer, messages[: i + 1], False, template_kwargs)
                if not prompt.startswith(done) or not full.startswith(prompt):
                    where = "its generation prompt" if prompt.startswith(done) else "an earlier turn"
                    raise NotIncrementalTemplate(
                        f"the chat template renders assistant turn {i} otherwise than {where} led to expect; cannot "
                        "cut the turns out of the whole conversation")
                spans += [(prompt[len(done):], False, range(first, i)), (full[len(prompt):], True, range(i, i + 1))]
                done, first = full, i + 1
        rest = _render(tokenizer, messages, False, template_kwargs)[len(done):]
        if rest:
            spans.append((rest, False, range(first, len(messages))))
        return spans
    eos = tokenizer.eos_token or ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            spans += [("assistant: ", False, range(i, i)), (message["content"] + eos + "\n", True, range(i, i + 1))]
        else:
            spans.append((f"{message['role']}: {message['content']}\n", False, range(i, i + 1)))
    return spans


def tokenize_record(
    tokenizer: PreTrainedTokenizerBase, record: dict[str, Any], fmt: str, max_length: int,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, list[int]]:
    """Token ids and loss mask of one record (truncated to max_length tokens); `template_kwargs`: the chat template's
    keywords (`enable_thinking`, ...).

    Raises:
        NotIncrementalTemplate: a conversation the template cannot render turn by turn (`tokenized_examples` splits
            it into one example per assistant turn instead).
    """
    if fmt in ("text", "completion"):  # raw text: the whole text trained, or the completion after its prompt
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        prompt = str(record.get("prompt") or "") if fmt == "completion" else ""
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids if prompt else []
        answer = tokenizer(str(record[fmt]), add_special_tokens=False).input_ids
        ids, mask = bos + prompt_ids + answer, [0] * (len(bos) + len(prompt_ids)) + [1] * len(answer)
        return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}
    messages = prompted_messages(tokenizer, to_messages(record, fmt))
    if not any(m["role"] == "assistant" for m in messages):  # nothing to train (its answers had no prompt)
        return {"input_ids": [], "loss_mask": []}
    segments = conversation_segments(tokenizer, messages, record_template_kwargs(record, template_kwargs))
    return _tokenized(tokenizer, segments, max_length)


def _tokenized(tokenizer: PreTrainedTokenizerBase, segments: list[tuple[str, bool]], max_length: int) -> dict[str, list[int]]:
    """Token ids and loss mask of conversation pieces (a BOS in front when there is no chat template to write it)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and not tokenizer.chat_template else []
    ids, mask = list(bos), [0] * len(bos)
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids += piece
        mask += [int(trained)] * len(piece)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def tokenized_examples(
    tokenizer: PreTrainedTokenizerBase, record: dict[str, Any], fmt: str, max_length: int,
    template_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, list[int]]]:
    """The examples of one record: itself (`tokenize_record`), or, for a conversation the chat template cannot
    render turn by turn (Qwen3 drops earlier turns' reasoning once a later user turn follows; a generation prompt
    writes more than the turn's own rendering, as `<think></think>` with enable_thinking=False), one example per
    assistant turn: the prompt the target answers that turn after, then the answer, the only part trained
    (`answer_after_prompt`). Each turn is then trained with the context it has when the target answers it."""
    try:
        return [tokenize_record(tokenizer, record, fmt, max_length, template_kwargs)]
    except NotIncrementalTemplate:
        messages = prompted_messages(tokenizer, to_messages(record, fmt))
        template_kwargs = record_template_kwargs(record, template_kwargs)
        examples = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt, answer = answer_after_prompt(tokenizer, messages, i, template_kwargs)
                examples.append(_tokenized(tokenizer, [(prompt, False), (answer, True)], max_length))
        return examples


def answer_after_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], i: int, template_kwargs: dict[str, Any] | None = None
) -> tuple[str, str]:
    """(the prompt the target answers assistant turn i after: messages[:i] with the generation prompt, the answer as
    the template writes it after that prompt).

    The answer is what rendering messages[: i + 1] adds to the prompt. A generation prompt that writes more than the
    template's rendering of the turn (Qwen3's `<think></think>` with enable_thinking=False) is kept, and the answer
    starts where the two renderings part: the tokens the target produced after exactly that prompt.

    Raises:
        NotIncrementalTemplate: the renderings part before the turn (the template rewrites the earlier ones).
    """
    prompt = _render(tokenizer, messages[:i], True, template_kwargs)
    full = _render(tokenizer, messages[: i + 1], False, template_kwargs)
    if full.startswith(prompt):
        return prompt, full[len(prompt):]
    shared = len(os.path.commonprefix([prompt, full]))
    if shared < len(_render(tokenizer, messages[:i], False, template_kwargs)):
        raise NotIncrementalTemplate(f"the chat template renders the conversation before assistant turn {i} otherwise "
                                     "when the turn follows; cannot cut the turn out")
    return prompt, full[shared:]


def normalized(text: str) -> str:
    """`text` with each run of whitespace made one space: how prompts are compared (benchmark exclusion)."""
    return " ".join(text.split())


def asks_any(messages: list[dict[str, str]], prompts: set[str]) -> bool:
    """Whether a conversation (`to_messages`) has a user turn among `prompts` (`normalized` texts)."""
    return any(m["role"] == "user" and normalized(m["content"]) in prompts for m in messages)
