"""Benchmark prompts: MT-bench-style JSONL (first turn, chat template applied; later turns on request) or plain text
lines."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt, tokenised for the target."""

    prompt_id: str
    category: str
    text: str
    input_ids: torch.Tensor  # (1, n)
    turns: tuple[str, ...] = ()  # every user turn of a multi-turn record (MT-bench: 2); `text` is the one asked here
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # its images' model inputs (vision-language target)


def read_prompts(
    path: str | Path, categories: list[str] | None = None, limit: int | None = None, per_category: int | None = None
) -> list[dict]:
    """Raw prompts as dicts {prompt_id, category, text, turns}: `per_category` keeps the first N of each category,
    then `limit` the first N in all.

    JSONL lines with `turns` (MT-bench: `text` is the first, `turns` keeps them all for `follow_up`), `prompt` (a
    string, or a list of turns), `text`, or a conversation (`messages` / `conversations`: its user turns); the
    same records from a JSON or Parquet file, a dataset folder or a Hub dataset id[:split] (the training data
    sources); any other file is read as one prompt per non-empty line (category "text").
    """
    source = str(path)
    path = Path(path)
    local = path.suffix in (".jsonl", ".json", ".parquet", ".txt") or source.startswith((".", "/", "~"))
    if local and not path.exists():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    rows = []
    if path.is_file() and path.suffix == ".jsonl":
        for number, line in enumerate(path.read_text().split("\n"), start=1):  # not splitlines(): U+2028 in JSON
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not valid JSON: {err}") from err
            rows.append(prompt_row(record, f"{path}:{number}", number, path.parent))
    elif path.is_file() and path.suffix not in (".json", ".parquet"):
        for number, line in enumerate(path.read_text().split("\n"), start=1):
            if line.strip():
                rows.append({"prompt_id": str(number), "category": "text", "text": line.strip(), "turns": [line.strip()]})
    else:
        # JSON / Parquet files, dataset folders, Hub dataset ids: the training data sources
        from specheads.training.data import read_records

        folder = path.parent if path.is_file() else path
        rows = [prompt_row(record, f"{source} record {n}", n, folder) for n, record in enumerate(read_records(source))]
    if categories:
        known = sorted({r["category"] for r in rows})
        unknown = set(categories) - set(known)
        if unknown:
            raise ValueError(f"categories {sorted(unknown)} not in {source}; known: {known}")
        rows = [r for r in rows if r["category"] in categories]
    if per_category is not None:
        if per_category < 1:
            raise ValueError(f"per_category={per_category}; expected at least 1 prompt per category")
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            if seen[r["category"]] <= per_category:
                kept.append(r)
        rows = kept
    return rows[:limit] if limit else rows


def record_images(record: dict, where: str, folder: Path | None) -> list[Any]:
    """The record's `image` / `images` (a path, relative to `folder`, or a PIL image as a dataset's Image column
    gives it; or a list of them), as absolute paths and images; [] without either field."""
    images = record.get("images", record.get("image"))
    if images is None:
        return []
    if not isinstance(images, list):
        images = [images]
    found = []
    for image in images:
        if isinstance(image, str):
            path = Path(image).expanduser()
            found.append(str(path if path.is_absolute() or folder is None else folder / path))
        elif hasattr(image, "convert"):  # a PIL image
            found.append(image)
        else:
            raise ValueError(f"{where} has an image {type(image).__name__}; expected a file path or a PIL image")
    return found


def prompt_row(record: object, where: str, number: int, folder: Path | None = None) -> dict:
    """One prompt record -> {prompt_id, category, text, turns[, images]}; a ValueError naming `where` when it holds
    no prompt. `images`: the record's `image` / `images` (`record_images`; paths relative to `folder`)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}; expected an object with 'turns', 'prompt' or "
                         "'text'")
    turns = record.get("turns")
    if turns is None and isinstance(record.get("prompt"), list):  # e.g. HuggingFaceH4/mt_bench_prompts
        turns = record["prompt"]
    if turns is None and ("messages" in record or "conversations" in record):
        from specheads.training.conversations import to_messages
        from specheads.training.data import detect_format

        messages = to_messages(record, detect_format(record))
        turns = [m["content"] for m in messages if m["role"] == "user"] or None
    if turns is not None and not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
        raise ValueError(f"{where} has turns={turns!r}; expected a non-empty list of strings")
    text = turns[0] if turns else record.get("prompt") or record.get("text")
    if not text or not isinstance(text, str):
        raise ValueError(f"{where} has no 'turns', 'prompt' or 'text' field holding text (nor a conversation with a "
                         "user turn)")
    prompt_id = next((record[k] for k in ("question_id", "prompt_id", "id") if record.get(k) is not None), number)
    row = {"prompt_id": str(prompt_id), "category": str(record.get("category", "default")), "text": text,
           "turns": list(turns) if turns else [text]}
    images = record_images(record, where, folder)
    if images:
        row["images"] = images
    return row


def tokenize_prompts(
    rows: list[dict], tokenizer: PreTrainedTokenizerBase, chat: bool | None = None, processor: Any = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[Prompt]:
    """Tokenise; the chat template is applied when the tokenizer has one (unless chat=False), with `template_kwargs`
    (`enable_thinking=False`, ...). Rows with `images` are made by `processor`, a vision-language target's
    (`multimodal.prompt_with_images`; a ValueError without one)."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    prompts = []
    for row in rows:
        if row.get("images"):
            from specheads.inference.multimodal import load_images, prompt_with_images

            if processor is None:
                raise ValueError(f"prompt {row['prompt_id']} has images, but the target takes none here (it ships no "
                                 "image processor, or this command reads text prompts only)")
            ids, inputs = prompt_with_images(processor, row["text"], load_images(row["images"]), chat, template_kwargs)
            prompts.append(Prompt(row["prompt_id"], row["category"], row["text"], ids, (row["text"],), inputs))
            continue
        if use_chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": row["text"]}], add_generation_prompt=True, return_tensors="pt", return_dict=True,
                **(template_kwargs or {}),
            )["input_ids"]
        else:
            ids = tokenizer(row["text"], return_tensors="pt").input_ids
        prompts.append(Prompt(row["prompt_id"], row["category"], row["text"], ids, tuple(row.get("turns", [row["text"]]))))
    return prompts


def follow_up(
    prompt: Prompt, answers: list[str], tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any] | None = None
) -> Prompt:
    """Turn k + 1 of a multi-turn prompt, given the k answers so far: the chat template (with `template_kwargs`) over
    the first k + 1 user turns with the answers between them (MT-bench's second turn reads the first answer, as in
    its judge setup)."""
    k = len(answers)
    if not 0 < k < len(prompt.turns):
        raise ValueError(f"prompt {prompt.prompt_id} has {len(prompt.turns)} turns; cannot ask turn {k + 1}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"a later turn of prompt {prompt.prompt_id} needs a chat template; the tokenizer has none")
    messages: list[dict[str, str]] = []
    for question, answer in zip(prompt.turns, answers):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": prompt.turns[k]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                        **(template_kwargs or {}))
    return Prompt(prompt.prompt_id, prompt.category, prompt.turns[k], ids["input_ids"], prompt.turns)


def calibration_prompts(prompts: list[Prompt], count: int = 4) -> list[Prompt]:
    """Up to `count` prompts for tuning (`--tree auto`): the first of each category in file order, then the rest.

    Spread over categories because acceptance differs by category (code and math accept more than writing):
    a tree tuned on two writing prompts is tuned for writing.
    """
    if count < 1:
        raise ValueError(f"count={count!r} must be >= 1")
    firsts: list[Prompt] = []
    rest: list[Prompt] = []
    categories: set[str] = set()
    for prompt in prompts:
        (rest if prompt.category in categories else firsts).append(prompt)
        categories.add(prompt.category)
    return (firsts + rest)[:count]


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object given on the command line (`--chat-template-kwargs '{"enable_thinking": false}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object ({{\"key\": value}}), got "
                                         f"{type(value).__name__}")
    return value


def add_chat_template_kwargs(p: argparse.ArgumentParser) -> None:
    """`--chat-template-kwargs JSON`: keywords of the chat template (generate, chat, serve, bench, data)."""
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="keywords of the chat template, e.g. '{\"enable_thinking\": false}' (Qwen3-style reasoning "
                        "switch); give heads' training data the same ones (data.chat_template_kwargs)")
