"""Data sources beyond JSON / JSONL: Parquet files, folders of data files, saved DatasetDicts, Hub dataset ids."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from specheads.cli import main
from specheads.training.data import build_dataset, read_records
from specheads.training.data_sources import split_suffix

from .conftest import CONFIGS, overrides


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}?"},
                         {"role": "assistant", "content": f"Once upon a time, answer {i}."}], "prompt_id": str(i)}


TRAIN, TEST = [_chat(i) for i in range(6)], [_chat(100 + i) for i in range(3)]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """load_dataset's arrow cache in the test's folder, not the user's."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")


def _hub_layout(folder):
    """A dataset repo as the Hub lays one out: data/{split}-00000-of-00001.parquet and a card."""
    (folder / "data").mkdir(parents=True)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        pq.write_table(pa.Table.from_pylist(rows), folder / "data" / f"{split}-00000-of-00001.parquet")
    (folder / "README.md").write_text("# chats\n")
    return folder


def test_parquet_file_reads_like_the_same_jsonl(tmp_path, target_and_tokenizer):
    _, tok = target_and_tokenizer
    pq.write_table(pa.Table.from_pylist(TRAIN), tmp_path / "chats.parquet")
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in TRAIN))
    assert read_records(tmp_path / "chats.parquet") == TRAIN
    as_parquet, as_jsonl = build_dataset(tmp_path / "chats.parquet", tok), build_dataset(tmp_path / "chats.jsonl", tok)
    assert as_parquet["input_ids"] == as_jsonl["input_ids"] and sum(map(sum, as_parquet["loss_mask"])) > 0


def test_a_broken_parquet_file_is_named(tmp_path):
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"cut\.parquet is not a readable Parquet file"):
        read_records(tmp_path / "cut.parquet")


def test_folder_of_data_files_and_its_splits(tmp_path):
    folder = _hub_layout(tmp_path / "chats")
    assert read_records(folder) == TRAIN  # default split: train
    assert read_records(f"{folder}:test") == TEST
    with pytest.raises(ValueError, match=r"Unknown split \"validation\"(.|\n)*pick a split as SOURCE:SPLIT"):
        read_records(f"{folder}:validation")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no data files"):
        read_records(tmp_path / "empty")


def test_saved_dataset_dict_and_its_splits(tmp_path):
    DatasetDict({"train": Dataset.from_list(TRAIN), "test": Dataset.from_list(TEST)}).save_to_disk(tmp_path / "dd")
    assert read_records(tmp_path / "dd") == TRAIN and read_records(f"{tmp_path / 'dd'}:test") == TEST
    with pytest.raises(ValueError, match=r"has no split 'dev'; its splits are \['test', 'train'\]"):
        read_records(f"{tmp_path / 'dd'}:dev")
    Dataset.from_list(TEST).save_to_disk(tmp_path / "one")
    with pytest.raises(ValueError, match="one saved Dataset, without splits"):
        read_records(f"{tmp_path / 'one'}:test")


def test_hub_dataset_id_from_the_offline_cache(tmp_path, offline_hub_cache):
    offline_hub_cache.publish(_hub_layout(tmp_path / "repo"), "test-org/chats", repo_type="dataset")
    assert read_records("test-org/chats") == TRAIN
    assert read_records("test-org/chats:test") == TEST
    with pytest.raises(FileNotFoundError, match=r"Hub dataset 'test-org/missing' could not be fetched"):
        read_records("test-org/missing")


@pytest.mark.parametrize("source", ["./no/such.jsonl", "data/answers.jsonl", "answers.parquet"])
def test_a_missing_file_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist \(expected a JSON / JSONL / Parquet file"):
        read_records(source)


def test_a_split_of_a_single_file_is_refused(tmp_path):
    (tmp_path / "chats.jsonl").write_text(json.dumps(TRAIN[0]))
    with pytest.raises(ValueError, match="is one file"):
        read_records(f"{tmp_path / 'chats.jsonl'}:test")


def test_split_suffix():
    assert split_suffix("org/name:train_sft") == ("org/name", "train_sft")
    assert split_suffix("org/name") == ("org/name", None)
    assert split_suffix("weird:na/me") == ("weird:na/me", None)


def test_training_on_a_hub_dataset_with_a_held_out_split(tmp_path, offline_hub_cache, stories_file):
    """data.source and data.eval_source as Hub ids with splits: a training run reads both."""
    offline_hub_cache.publish(_hub_layout(tmp_path / "repo"), "test-org/chats", repo_type="dataset")
    out = tmp_path / "run"
    extra = {"data.source": "test-org/chats:train", "data.eval_source": "test-org/chats:test", "data.format": "auto",
             "global_batch_size": 4, "max_steps": 2,
             "save_steps": 2}
    assert main(["train", str(CONFIGS / "medusa_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_tokens"] > 0 and metrics["steps"] == 2


def test_a_list_of_sources_is_a_mixture_in_order(tmp_path, target_and_tokenizer, chat_file):
    """[ShareGPT JSONL, OpenAI Parquet]: each source's format detected on its own, rows concatenated in order."""
    _, tok = target_and_tokenizer
    pq.write_table(pa.Table.from_pylist(TRAIN), tmp_path / "chats.parquet")
    mixed = build_dataset([chat_file, tmp_path / "chats.parquet"], tok)
    first, second = build_dataset(chat_file, tok), build_dataset(tmp_path / "chats.parquet", tok)
    assert list(mixed["input_ids"]) == list(first["input_ids"]) + list(second["input_ids"])
    with pytest.raises(ValueError, match="empty list"):
        build_dataset([], tok)
    (tmp_path / "questions.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}))
    with pytest.raises(ValueError, match="questions.jsonl' .*has no assistant tokens"):
        build_dataset([chat_file, tmp_path / "questions.jsonl"], tok)


def test_tokenizing_a_large_source_shows_progress(tmp_path, target_and_tokenizer, capsys):
    _, tok = target_and_tokenizer
    rows = [_chat(i) for i in range(1000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "many.parquet")
    assert len(build_dataset(tmp_path / "many.parquet", tok)) == 1000
    assert "tokenize many.parquet" in capsys.readouterr().err
    build_dataset(tmp_path / "many.parquet", tok, progress=False)
    assert "tokenize" not in capsys.readouterr().err


def test_run_config_takes_a_list_of_sources(tmp_path, stories_file):
    from specheads.training.config import load_run_config

    config = load_run_config(None, [f"data.source=[{stories_file}, org/chats:train_sft]"])
    assert config.data.source == [str(stories_file), "org/chats:train_sft"]
    with pytest.raises(ValueError, match="data.source"):
        load_run_config(None, ["data.source={a: 1}"])


def test_benchmark_prompts_are_left_out_of_training_data(tmp_path, target_and_tokenizer, caplog):
    """exclude: conversations asking a benchmark prompt (any user turn, whitespace-normalised) are not trained on;
    the prompts may come from any prompt source (here a Parquet file of MT-bench-like records)."""
    from specheads.training.sharegpt import benchmark_prompts

    _, tok = target_and_tokenizer
    pq.write_table(pa.Table.from_pylist(TRAIN), tmp_path / "chats.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": ["Question  1?", "Later turn"]}, {"prompt": ["Question 4?"]}]),
                   tmp_path / "bench.parquet")
    exclude = benchmark_prompts(tmp_path / "bench.parquet")
    assert exclude == {"Question 1?", "Later turn", "Question 4?"}
    with caplog.at_level("WARNING"):
        kept = build_dataset(tmp_path / "chats.parquet", tok, exclude=exclude)
    assert len(kept) == len(TRAIN) - 2 and "left out 2 conversations" in caplog.text
    everything = build_dataset(tmp_path / "chats.parquet", tok)
    assert list(kept["input_ids"]) == [row for i, row in enumerate(everything["input_ids"]) if i not in (1, 4)]


def test_training_and_regeneration_skip_benchmark_prompts(tmp_path, stories_file, caplog):
    pq.write_table(pa.Table.from_pylist(TRAIN), tmp_path / "chats.parquet")
    (tmp_path / "bench.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["Question 0?"]}) + "\n")
    out = tmp_path / "regen.jsonl"
    assert main(["data", "regenerate", "--input", str(tmp_path / "chats.parquet"), "--output", str(out),
                 "--max-new-tokens", "2", "--exclude", str(tmp_path / "bench.jsonl")]) == 0
    asked = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    assert asked == [f"Question {i}?" for i in range(1, 6)]
    extra = {"data.source": str(tmp_path / "chats.parquet"), "data.format": "auto", "global_batch_size": 4,
             "max_steps": 1, "save_steps": 1, "data.exclude_prompts": str(tmp_path / "bench.jsonl")}
    with caplog.at_level("WARNING"):
        assert main(["train", str(CONFIGS / "medusa_stories260k.yaml"),
                     *overrides(stories_file, tmp_path / "run", **extra)]) == 0
    assert "left out 1 conversations that ask an excluded (benchmark) prompt" in caplog.text


def test_records_with_images_are_trained_as_text_with_a_warning(tmp_path, target_and_tokenizer, caplog):
    """A vision-language dataset (records with `image` / `images`): training reads the text alone and says so."""
    _, tok = target_and_tokenizer
    records = [{"conversations": [{"from": "human", "value": "Describe it."}, {"from": "gpt", "value": "A cat."}],
                "image": "coco/1.jpg"},
               {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}]
    path = tmp_path / "vqa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with caplog.at_level("WARNING"):
        rows = build_dataset(path, tok)
    assert len(rows) == 2 and "1 of 2 records hold images, which training does not read" in caplog.text
    path.write_text(json.dumps(records[1]) + "\n")
    caplog.clear()
    with caplog.at_level("WARNING"):
        build_dataset(path, tok)
    assert "hold images" not in caplog.text
