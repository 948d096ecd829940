"""Training records from Parquet files, dataset folders and Hub dataset ids (JSON / JSONL files: `data.py`).

    data.source=answers.parquet                          # one Parquet file (a Hub dataset's shard, say)
    data.source=my_dataset                               # a `save_to_disk` folder, or a folder of data files
    data.source=HuggingFaceH4/ultrachat_200k:train_sft   # a Hub dataset id, fetched once into the HF cache

`SOURCE:SPLIT` picks a split of a folder or Hub dataset that has several (default: train). A Hub dataset is
fetched with `huggingface_hub.snapshot_download` (its data files and card only; the offline cache works) and
read by `datasets.load_dataset` like a local folder of data files, so split names follow the Hub's conventions
(file names such as data/test-00000-of-00001.parquet, or the card's `configs`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from datasets import DatasetDict, load_dataset, load_from_disk

# what a Hub dataset's snapshot needs for load_dataset: the data files and the card (whose YAML may map splits)
DATA_FILE_PATTERNS = ["*.parquet", "*.arrow", "*.json", "*.jsonl", "*.json.gz", "*.jsonl.gz", "*.csv", "README.md"]
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".gz")  # a missing source with one is a missing file
SPLIT_NAME = re.compile(r"^[\w.-]+$")


def split_suffix(source: str) -> tuple[str, str | None]:
    """("location", "split") of "location:split"; (source, None) when it names no split or exists as written."""
    if Path(source).exists() or ":" not in source:
        return source, None
    location, split = source.rsplit(":", 1)
    return (location, split) if location and SPLIT_NAME.match(split) else (source, None)


def read_parquet(path: Path) -> list[dict[str, Any]]:
    """Every row of one Parquet file as a dict (nested columns such as `messages` become lists of dicts)."""
    import pyarrow.parquet as pq  # a dependency of datasets

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for truncated or foreign files
        raise ValueError(f"{path} is not a readable Parquet file: {err}") from err


def read_dataset_source(source: str) -> list[dict[str, Any]]:
    """The records of a dataset folder or Hub dataset id, optionally `:SPLIT`.

    Raises:
        FileNotFoundError: neither a local file or folder nor a Hub dataset that can be fetched (or found in
            the offline cache), or a folder without data.
        ValueError: the split does not exist (the message lists the splits there are).
    """
    location, split = split_suffix(source)
    folder = Path(location).expanduser()
    if folder.is_file():
        raise ValueError(f"data source {source!r}: :{split} picks a split of a dataset folder or Hub dataset; "
                         f"{location} is one file (drop the :{split})")
    if not folder.is_dir():
        folder = hub_dataset_folder(location, source)
    return read_dataset_folder(folder, split, source)


def hub_dataset_folder(repo_id: str, source: str) -> Path:
    """The local snapshot of Hub dataset `repo_id` (its data files and card), fetched unless cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    missing = (f"data source {source!r} does not exist (expected a JSON / JSONL / Parquet file, a dataset folder, "
               "or a Hub dataset id such as org/name[:split])")
    if repo_id.startswith((".", "/", "~")) or repo_id.endswith(FILE_SUFFIXES):
        raise FileNotFoundError(missing)
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=DATA_FILE_PATTERNS))
    except HFValidationError as err:
        raise FileNotFoundError(missing) from err
    except (OSError, HfHubHTTPError) as err:  # offline and not cached, no such repository, no network
        raise FileNotFoundError(
            f"data source {source!r} is not a local file or folder, and the Hub dataset {repo_id!r} could not be "
            f"fetched: {err}"
        ) from err


def read_dataset_folder(folder: Path, split: str | None, source: str) -> list[dict[str, Any]]:
    """Rows of a `save_to_disk` folder (a Dataset or DatasetDict) or of a folder of data files, one split."""
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        loaded = load_from_disk(str(folder))
        if isinstance(loaded, DatasetDict):
            split = split or "train"
            if split not in loaded:
                raise ValueError(f"data source {source!r} has no split {split!r}; its splits are {sorted(loaded)} "
                                 "(pick one as SOURCE:SPLIT)")
            loaded = loaded[split]
        elif split is not None:
            raise ValueError(f"data source {source!r}: {folder} holds one saved Dataset, without splits (drop the "
                             f":{split})")
    else:
        try:
            loaded = load_dataset(str(folder), split=split or "train")
        except ValueError as err:  # 'Unknown split "x". Should be one of [...]'
            raise ValueError(f"data source {source!r}: {err} (pick a split as SOURCE:SPLIT)") from err
        except FileNotFoundError as err:  # datasets' DataFilesNotFoundError / EmptyDatasetError
            raise FileNotFoundError(
                f"data source {source!r}: {folder} holds no data files (Parquet, JSON, JSONL, CSV, Arrow) and no "
                f"saved dataset: {err}"
            ) from err
    return [dict(row) for row in loaded]
