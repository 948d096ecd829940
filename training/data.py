"""Training data: conversations or plain text -> token ids + a loss mask, and a deterministic batch order.

Sources: a local JSON / JSONL / Parquet file, a dataset folder (`save_to_disk`, or data files) or a Hub dataset id
(`org/name`, `org/name:split`: data_sources.py).
Formats (one record each):

    sharegpt: {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}
    openai:   {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    text:     {"text": "..."}                      (every token is trained; stories260K's own stories)

Conversations go through the tokenizer's chat template when it has one, else a plain "role: text" layout
(conversations.py); records with images through a vision-language target's processor (image_records.py). The loss
mask is 1 on assistant tokens only: `loss_mask[i] == 1` means "predicting token i is trained".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, Features, Image, List, Value
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specheads.training.conversations import (
    asks_any,
    to_messages,
    tokenized_examples,
    unprompted_answers,
    unrendered_fields,
)
from specheads.training.data_sources import read_dataset_source, read_parquet

logger = logging.getLogger(__name__)

PROGRESS_MIN_RECORDS = 1000  # tokenizing runs ~1-2 ms a conversation: a bar from here on


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


# the field each format reads; "completion": {"prompt", "completion"} records (TRL's prompt-completion datasets, and
# `serve --record`'s /v1/completions answers), strings (plain text) or lists of messages (a conversation)
FORMAT_FIELDS = {"sharegpt": "conversations", "openai": "messages", "text": "text", "completion": "completion"}
PLAIN_FORMATS = ("text", "completion")  # tokenized as raw text: no chat template, no turns
DATA_FORMATS = ("auto", *FORMAT_FIELDS)  # data.format / --format: "auto" reads each record's from its keys


def detect_format(record: dict[str, Any]) -> str:
    """'sharegpt', 'openai', 'text' or 'completion', from the keys of one record (the first of FORMAT_FIELDS' fields it
    has)."""
    for fmt, field in FORMAT_FIELDS.items():
        if field in record:
            return fmt
    raise ValueError(f"cannot tell the data format of a record with keys {sorted(record)}; "
                     "expected 'conversations' (ShareGPT), 'messages' (OpenAI), 'text' or 'prompt' + 'completion'")


def conversation_form(record: dict[str, Any], fmt: str) -> tuple[dict[str, Any], str]:
    """(record, format) as it is read: a prompt-completion record whose prompt and completion are lists of messages
    (TRL's conversational form) as the OpenAI record they make ({"messages": prompt + completion, ...its other
    fields}), any other record as it is."""
    if fmt != "completion" or not isinstance(record.get("completion"), list):
        return record, fmt
    rest = {k: v for k, v in record.items() if k not in ("prompt", "completion")}
    return {**rest, "messages": [*(record.get("prompt") or []), *record["completion"]]}, "openai"


def build_dataset(
    source: str | Path | Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, fmt: str = "auto",
    max_length: int = 512, progress: bool = True, exclude: set[str] | None = None, processor: Any = None,
    image_folder: str | Path | None = None, chat_template_kwargs: dict[str, Any] | None = None,
) -> Dataset:
    """Tokenize one data source, or a list of them (a mixture, concatenated in order), into a `datasets.Dataset`
    with columns input_ids, loss_mask, length.

    Args:
        source: a file, folder or Hub dataset id (`read_records`), or a list of those; with fmt="auto" each
            record's format is read from its keys (a source may mix formats).
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
    """One source's records, checked against their format and tokenized (rows of fewer than 3 tokens dropped). With
    fmt="auto", records of several formats (`serve --record`'s conversations and prompt-completions) are tokenized
    format by format."""
    records = read_records(source)
    if not records:
        raise ValueError(f"data source {str(source)!r} holds no records")
    if fmt not in ("auto", "completion"):
        return _format_rows(records, source, tokenizer, fmt, max_length, progress, exclude, processor, image_folder,
                            chat_template_kwargs)
    formats = []
    for number, record in enumerate(records):
        try:
            kind = detect_format(record if isinstance(record, dict) else {}) if fmt == "auto" else fmt
        except ValueError as err:
            raise ValueError(f"data source {str(source)!r}, record {number}: {err}") from err
        if isinstance(record, dict):  # prompt-completion conversations (TRL's form) are read as conversations
            records[number], kind = conversation_form(record, kind)
        formats.append(kind)
    rows: list[dict[str, Any]] = []
    for kind in dict.fromkeys(formats):  # in the order they first appear
        rows += _format_rows([r for r, f in zip(records, formats, strict=True) if f == kind], source, tokenizer, kind,
                             max_length, progress, exclude, processor, image_folder, chat_template_kwargs)
    return rows


def _format_rows(
    records: list[Any], source: str | Path, tokenizer: PreTrainedTokenizerBase, fmt: str, max_length: int,
    progress: bool, exclude: set[str] | None, processor: Any, image_folder: str | Path | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """`_tokenized_rows` of records of one format `fmt`."""
    # imported here: image_records builds on this module's conversation helpers
    from specheads.training.image_records import has_images, tokenize_image_record

    field = FORMAT_FIELDS.get(fmt)
    if field is None:
        raise ValueError(f"data format {fmt!r} is unknown; expected one of {sorted(FORMAT_FIELDS)} or 'auto'")
    for number, record in enumerate(records):
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"data source {str(source)!r}, record {number}: the {fmt} format needs a {field!r} field, "
                             f"found {keys} (data.format=auto reads each record's format from its keys)")
    with_images = sum(1 for r in records if has_images(r))
    read_images = bool(with_images) and processor is not None and fmt not in PLAIN_FORMATS
    if with_images and not read_images:  # (a vision-language dataset: LLaVA-Instruct, ALLaVA, ...)
        why = "the target takes no images (no processor with an image processor)" if processor is None else \
            "plain-text records have no turns to place them in"
        logger.warning("data source %r: %d of %d records hold images, which training does not read (%s): the heads "
                       "train on their text alone, as if no image were there", str(source), with_images, len(records), why)
    for name, count in (unrendered_fields(tokenizer, records, fmt) if fmt not in PLAIN_FORMATS else {}).items():
        logger.warning("data source %r: %d records hold %s, which the chat template never renders: it is not trained "
                       "(reasoning: put it in the content, inside the model's thinking tags)", str(source), count, name)
    if fmt not in PLAIN_FORMATS and tokenizer.chat_template:
        unprompted = sum(1 for r in records if unprompted_answers(to_messages(r, fmt)))
        if unprompted:
            logger.warning("data source %r: %d conversations open with an assistant turn (no user turn before it): "
                           "those turns are left out, the rest of each conversation is trained", str(source), unprompted)
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
