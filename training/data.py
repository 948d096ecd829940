"""Training data: conversations or plain text -> token ids + a loss mask, and a deterministic batch order.

Sources: a local JSON / JSONL / Parquet file, a dataset folder (`save_to_disk`, or data files) or a Hub dataset id
(`org/name`, `org/name:split`: data_sources.py).
Formats (one record each):

    sharegpt: {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}
    openai:   {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    text:     {"text": "..."}                      (every token is trained; stories260K's own stories)

Conversations go through the tokenizer's chat template when it has one, else a plain "role: text" layout.
The loss mask is 1 on assistant tokens only: `loss_mask[i] == 1` means "predicting token i is trained".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, Features, Image, List, Value
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specheads.training.data_sources import read_dataset_source, read_parquet

logger = logging.getLogger(__name__)

PROGRESS_MIN_RECORDS = 1000  # tokenizing runs ~1-2 ms a conversation: a bar from here on

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


def read_records(source: str | Path) -> list[dict[str, Any]]:
    """Read raw records from a .json (a list, or {"data": [...]}) / .jsonl / .parquet file, a dataset folder
    (`save_to_disk`, or a folder of data files) or a Hub dataset id; `SOURCE:SPLIT` picks a split (data_sources.py)."""
    path = Path(source)
    if not path.is_file():
        return read_dataset_source(str(source))
    if path.suffix == ".parquet":
        return [_record(row, f"{path} row {i}") for i, row in enumerate(read_parquet(path))]
    text = path.read_text()
    if path.suffix == ".jsonl" or (text.lstrip()[:1] == "{" and "\n{" in text.strip()):
        # not splitlines(): U+2028 may be inside a string
        numbered = ((f"{path}:{n}", line) for n, line in enumerate(text.split("\n"), start=1) if line.strip())
        return [_record(_parse_json(line, where), where) for where, line in numbered]
    data = _parse_json(text, str(path))
    if isinstance(data, dict):
        data = data.get("data", data.get("train", [data]))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return [_record(record, f"{path} record {i}") for i, record in enumerate(data)]


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON: {err}") from err


def _record(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} is a JSON {type(value).__name__}; expected an object (one record)")
    return value


FORMAT_FIELDS = {"sharegpt": "conversations", "openai": "messages", "text": "text"}  # the field each format reads


def detect_format(record: dict[str, Any]) -> str:
    """'sharegpt', 'openai' or 'text', from the keys of one record (the first of FORMAT_FIELDS' fields it has)."""
    for fmt, field in FORMAT_FIELDS.items():
        if field in record:
            return fmt
    raise ValueError(f"cannot tell the data format of a record with keys {sorted(record)}; "
                     "expected 'conversations' (ShareGPT), 'messages' (OpenAI) or 'text'")


def to_messages(record: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    """A ShareGPT or OpenAI record as a list of {"role", "content"} messages; a turn's `reasoning_content` (a
    reasoning model's thoughts, as vLLM and DeepSeek's API return them) is kept for the chat templates that render
    it (Qwen3's)."""
    if fmt == "sharegpt":
        messages = []
        for turn in record["conversations"]:
            speaker = str(turn.get("from", "")).lower()
            if speaker not in SHAREGPT_ROLES:
                raise ValueError(f"ShareGPT turn has unknown speaker from={turn.get('from')!r}; "
                                 f"expected one of {sorted(SHAREGPT_ROLES)}")
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": str(turn.get("value", "")),
                             **_reasoning(turn)})
        return messages
    return [{"role": str(m["role"]), "content": message_text(m["content"]), **_reasoning(m)} for m in record["messages"]]


def _reasoning(turn: dict[str, Any]) -> dict[str, str]:
    return {"reasoning_content": str(turn["reasoning_content"])} if turn.get("reasoning_content") else {}


def reads_reasoning(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a message's `reasoning_content`."""
    return "reasoning_content" in str(getattr(tokenizer, "chat_template", None) or "")


def message_text(content: Any) -> str:
    """A message's text: the string itself, or the text parts of a list of content parts (`{"type": "text",
    "text": ...}`) joined; other parts (images) are left out."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text")
    return str(content)


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
    if fmt == "text":
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids = bos + tokenizer(str(record["text"]), add_special_tokens=False).input_ids
        mask = [0] * len(bos) + [1] * (len(ids) - len(bos))
        return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}
    return _tokenized(tokenizer, conversation_segments(tokenizer, to_messages(record, fmt), template_kwargs), max_length)


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
        messages = to_messages(record, fmt)
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


def build_dataset(
    source: str | Path | Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, fmt: str = "auto",
    max_length: int = 512, progress: bool = True, exclude: set[str] | None = None, processor: Any = None,
    image_folder: str | Path | None = None, chat_template_kwargs: dict[str, Any] | None = None,
) -> Dataset:
    """Tokenize one data source, or a list of them (a mixture, concatenated in order), into a `datasets.Dataset`
    with columns input_ids, loss_mask, length.

    Args:
        source: a file, folder or Hub dataset id (`read_records`), or a list of those; with fmt="auto" each
            source's format is detected from its first record.
        progress: show a progress bar while tokenizing (for sources of 1000 records or more).
        exclude: whitespace-normalised prompts (`sharegpt.benchmark_prompts`): conversations with a user turn among
            them are left out (a warning says how many), so heads are never trained on what they are measured on.
        processor: a vision-language target's processor: records that hold images are tokenized with their images
            (image_records.py) and the dataset gets the columns images and image_pieces (`ImageCollate` reads them).
            Without one, such records are trained as text (a warning says how many).
        image_folder: where relative image paths are read from (default: the data file's folder).
        chat_template_kwargs: keywords of the chat template (`enable_thinking=False`, ...): give those the target is
            prompted with at inference. A conversation the template cannot render turn by turn (Qwen3 drops earlier
            turns' reasoning) becomes one example per assistant turn (`tokenized_examples`; a log line counts them).

    Raises:
        ValueError: an unknown format, a record without its format's field, or a source without trainable
            (assistant) tokens.
    """
    sources = [source] if isinstance(source, (str, Path)) else list(source)
    if not sources:
        raise ValueError("no data source given (an empty list)")
    rows: list[dict[str, Any]] = []
    for one in sources:
        rows += _tokenized_rows(one, tokenizer, fmt, max_length, progress, exclude, processor, image_folder,
                                chat_template_kwargs)
    columns = {
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [r["loss_mask"] for r in rows],
        "length": [len(r["input_ids"]) for r in rows],
    }
    if not any("images" in r for r in rows):
        return Dataset.from_dict(columns)
    columns.update(images=[r.get("images", []) for r in rows], image_pieces=[r.get("image_pieces", "[]") for r in rows])
    features = Features({"input_ids": List(Value("int64")), "loss_mask": List(Value("int64")), "length": Value("int64"),
                         "images": List(Image()), "image_pieces": Value("string")})
    return Dataset.from_dict(columns, features=features)


def _tokenized_rows(
    source: str | Path, tokenizer: PreTrainedTokenizerBase, fmt: str, max_length: int, progress: bool,
    exclude: set[str] | None = None, processor: Any = None, image_folder: str | Path | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One source's records, checked against their format and tokenized (rows of fewer than 3 tokens dropped)."""
    # imported here: image_records builds on this module's conversation helpers
    from specheads.training.image_records import has_images, tokenize_image_record

    records = read_records(source)
    if not records:
        raise ValueError(f"data source {str(source)!r} holds no records")
    fmt = detect_format(records[0]) if fmt == "auto" else fmt
    field = FORMAT_FIELDS.get(fmt)
    if field is None:
        raise ValueError(f"data format {fmt!r} is unknown; expected one of {sorted(FORMAT_FIELDS)} or 'auto'")
    for number, record in enumerate(records):
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"data source {str(source)!r}, record {number}: the {fmt} format needs a {field!r} field, "
                             f"found {keys} (data.format=auto detects the format from the first record)")
    with_images = sum(1 for r in records if has_images(r))
    read_images = bool(with_images) and processor is not None and fmt != "text"
    if with_images and not read_images:  # (a vision-language dataset: LLaVA-Instruct, ALLaVA, ...)
        why = "the target takes no images (no processor with an image processor)" if processor is None else \
            "plain-text records have no turns to place them in"
        logger.warning("data source %r: %d of %d records hold images, which training does not read (%s): the heads "
                       "train on their text alone, as if no image were there", str(source), with_images, len(records), why)
    if fmt != "text" and not reads_reasoning(tokenizer):
        thoughtful = sum(1 for r in records if any("reasoning_content" in m for m in to_messages(r, fmt)))
        if thoughtful:
            logger.warning("data source %r: %d records hold reasoning_content, which the chat template never renders: "
                           "their reasoning is not trained (put it in the content, inside the model's thinking tags)",
                           str(source), thoughtful)
    if exclude and fmt != "text":
        kept = [r for r in records if not asks_any(to_messages(r, fmt), exclude)]
        if len(kept) < len(records):
            logger.warning("data source %r: left out %d conversations that ask an excluded (benchmark) prompt",
                           str(source), len(records) - len(kept))
        records = kept
    if image_folder is None and read_images:
        path = Path(str(source))
        image_folder = path.parent if path.is_file() else path if path.is_dir() else None
    bar = tqdm(records, desc=f"tokenize {Path(str(source)).name}", unit="rec",
               disable=not progress or len(records) < (1 if read_images else PROGRESS_MIN_RECORDS))
    rows, too_long, split = [], 0, 0
    for number, record in enumerate(bar):
        if not (read_images and has_images(record)):
            examples = tokenized_examples(tokenizer, record, fmt, max_length, chat_template_kwargs)
            split += len(examples) > 1
            rows += examples
            continue
        try:
            row = tokenize_image_record(processor, record, fmt, max_length,
                                        None if image_folder is None else Path(image_folder), chat_template_kwargs)
        except (ValueError, FileNotFoundError) as err:
            raise type(err)(f"data source {str(source)!r}, record {number}: {err}") from err
        too_long += row is None
        rows += [row] if row is not None else []
    if split:
        logger.info("data source %r: the chat template renders earlier turns otherwise once later ones follow; %d "
                    "multi-turn conversations were cut into one example per assistant turn", str(source), split)
    if too_long:
        logger.warning("data source %r: left out %d records whose images do not fit in data.max_length=%d tokens",
                       str(source), too_long, max_length)
    rows = [r for r in rows if len(r["input_ids"]) >= 3]
    if not rows and too_long:
        raise ValueError(f"data source {str(source)!r}: every record was left out, their images do not fit in "
                         f"data.max_length={max_length} tokens; raise data.max_length")
    if not rows or sum(sum(r["loss_mask"]) for r in rows) == 0:
        raise ValueError(f"data source {str(source)!r} ({fmt} format) has no assistant tokens to train on; "
                         "each conversation needs at least one assistant/gpt turn")
    return rows


def normalized(text: str) -> str:
    """`text` with each run of whitespace made one space: how prompts are compared (benchmark exclusion)."""
    return " ".join(text.split())


def asks_any(messages: list[dict[str, str]], prompts: set[str]) -> bool:
    """Whether a conversation (`to_messages`) has a user turn among `prompts` (`normalized` texts)."""
    return any(m["role"] == "user" and normalized(m["content"]) in prompts for m in messages)


def collate(rows: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest one.

    Returns:
        input_ids (B, T) long, attention_mask (B, T) long, loss_mask (B, T) long (0 on padding).
    """
    width = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in ("input_ids", "attention_mask", "loss_mask")}
    batch["input_ids"].fill_(pad_token_id)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = torch.as_tensor(r["loss_mask"])
    return batch


def batch_to(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """A batch on `device`: its tensors, and the tensors of its image rows' inputs (`row_inputs`, when present)."""
    moved = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if "row_inputs" in batch:
        moved["row_inputs"] = [None if row is None else {k: v.to(device) for k, v in row.items()}
                               for row in batch["row_inputs"]]
    return moved


@dataclass
class BatchOrder:
    """Which examples make up the global batch of every step: a pure function of (seed, step).

    Each epoch is a seeded permutation (dropping the last partial batch). With length bucketing, windows of
    50 global batches are sorted by length, cut into batches, and the batches shuffled, so padding stays small.
    The order does not depend on the number of processes, which is what makes resume and 1-vs-N-process
    runs identical.
    """

    lengths: list[int]
    global_batch_size: int
    seed: int
    bucket_by_length: bool = True

    def __post_init__(self) -> None:
        if len(self.lengths) < self.global_batch_size:
            raise ValueError(f"the dataset has {len(self.lengths)} examples, fewer than global_batch_size="
                             f"{self.global_batch_size}")
        self.steps_per_epoch = len(self.lengths) // self.global_batch_size
        self._epoch: int | None = None
        self._batches: list[list[int]] = []

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        order = order[: self.steps_per_epoch * self.global_batch_size]
        if not self.bucket_by_length:
            return [order[i: i + self.global_batch_size] for i in range(0, len(order), self.global_batch_size)]
        window = 50 * self.global_batch_size
        batches = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start: start + window], key=lambda i: self.lengths[i])
            batches += [chunk[i: i + self.global_batch_size] for i in range(0, len(chunk), self.global_batch_size)]
        shuffle = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in shuffle]

    def global_batch(self, step: int) -> list[int]:
        """Example indices of the global batch of optimizer step `step` (0-based)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, self._epoch_batches(epoch)
        return self._batches[index]


def micro_batches_for_process(global_batch: list[int], micro_batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """This process's micro-batches: the global batch cut into micro-batches, dealt round-robin to processes."""
    chunks = [global_batch[i: i + micro_batch_size] for i in range(0, len(global_batch), micro_batch_size)]
    return chunks[rank::world_size]
