"""`specheads data regenerate` (batched, resumable) and `specheads data dump-features` (shards + index)."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.cli import main
from specheads.training.data import build_dataset
from specheads.training.data_cli import regenerate
from specheads.training.features import OfflineFeatures, collate_offline, file_sha256, online_features


def test_regenerate_stories_is_resumable(tmp_path, target_and_tokenizer):
    target, tok = target_and_tokenizer
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    kwargs = dict(stories=6, max_new_tokens=12, batch_size=4, seed=1, show_progress=False)
    assert regenerate(target, tok, full, **kwargs) == 6
    lines = full.read_text().splitlines()
    assert len({json.loads(x)["text"] for x in lines}) > 1  # sampled: the stories vary
    part.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])  # killed mid-write of record 4
    assert regenerate(target, tok, part, **kwargs) == 3
    assert part.read_text() == full.read_text()
    assert regenerate(target, tok, full, **kwargs) == 0  # all done: nothing written


def test_regenerate_conversations_through_cli(tmp_path, chat_file, capsys):
    out = tmp_path / "regen.jsonl"
    assert main(["data", "regenerate", "--target", "stories260K", "--input", str(chat_file), "--output", str(out),
                 "--max-new-tokens", "8", "--batch-size", "2"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b"]
    assert records[0]["messages"][0] == {"role": "user", "content": "Tell me a story."}
    assert records[0]["messages"][-1]["role"] == "assistant"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["written"] == 2


def test_regenerate_reads_conversational_prompt_completions_and_refuses_plain_ones(tmp_path, capsys):
    """TRL's conversational prompt-completion records are conversations to answer; plain ones (raw text) are not."""
    source = tmp_path / "trl.jsonl"
    source.write_text(json.dumps({"id": "t", "prompt": [{"role": "user", "content": "Tell me a story."}],
                                  "completion": [{"role": "assistant", "content": "Once."}]}) + "\n")
    out = tmp_path / "regen.jsonl"
    assert main(["data", "regenerate", "--target", "stories260K", "--input", str(source), "--output", str(out),
                 "--max-new-tokens", "8"]) == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert record["messages"][0] == {"role": "user", "content": "Tell me a story."}
    assert record["messages"][-1]["role"] == "assistant"
    source.write_text(json.dumps({"prompt": "Once upon", "completion": " a time"}) + "\n")
    assert main(["data", "regenerate", "--target", "stories260K", "--input", str(source), "--output",
                 str(tmp_path / "plain.jsonl")]) == 2
    assert "regenerate needs conversations (ShareGPT or OpenAI), got plain prompt-completion records" in \
        capsys.readouterr().err


def test_regenerate_several_sampled_answers_per_prompt(tmp_path, chat_file, target_and_tokenizer, capsys):
    """--answers 3: each prompt answered three times (ids a, a#1, a#2), sampled apart; resumed by id; greedy refused."""
    target, tok = target_and_tokenizer
    out = tmp_path / "regen.jsonl"
    kwargs = dict(input_path=chat_file, max_new_tokens=12, batch_size=4, seed=2, show_progress=False, answers_per_prompt=3)
    assert regenerate(target, tok, out, **kwargs) == 6
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "a#1", "a#2", "b", "b#1", "b#2"]
    assert all(r["messages"][:-1] == records[0]["messages"][:-1] for r in records[:3])  # one prompt, three answers
    assert len({r["messages"][-1]["content"] for r in records[:3]}) == 3  # sampled apart
    whole = out.read_text()
    out.write_text("".join(whole.splitlines(keepends=True)[:4]))  # stopped after b: b#1 and b#2 are asked again
    assert regenerate(target, tok, out, **kwargs) == 2
    assert out.read_text() == whole  # and answered as the uninterrupted run answered them
    with pytest.raises(ValueError, match="--answers 3 needs --temperature > 0"):
        regenerate(target, tok, tmp_path / "greedy.jsonl", **{**kwargs, "temperature": 0.0})
    assert main(["data", "regenerate", "--input", str(chat_file), "--output", str(tmp_path / "x.jsonl"),
                 "--answers", "0"]) == 2
    assert "--answers 0: expected a positive number" in capsys.readouterr().err


def test_regenerate_answers_conversations_that_open_with_an_assistant_turn(tmp_path, target_and_tokenizer):
    """A split ShareGPT conversation opening with "gpt": its first human turn (and a system turn) is the prompt."""
    target, tok = target_and_tokenizer
    source = tmp_path / "split.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in [
        {"id": "x", "conversations": [{"from": "system", "value": "Be kind."}, {"from": "gpt", "value": "...the end."},
                                      {"from": "human", "value": "Another story?"}, {"from": "gpt", "value": "Sure."}]},
        {"id": "y", "conversations": [{"from": "gpt", "value": "Only me."}]},
    ]))
    out = tmp_path / "regen.jsonl"
    assert regenerate(target, tok, out, input_path=source, max_new_tokens=4, show_progress=False) == 1
    record = json.loads(out.read_text())
    assert record["id"] == "x" and [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
    assert record["messages"][1]["content"] == "Another story?"


def test_regenerate_the_first_conversations_of_a_parquet_source(tmp_path, capsys):
    """--input takes any data source (here Parquet, ids from the row numbers); --limit N answers the first N."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"Story {i}?"}]} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts.parquet")
    out = tmp_path / "regen.jsonl"
    assert main(["data", "regenerate", "--input", str(tmp_path / "prompts.parquet"), "--output", str(out),
                 "--max-new-tokens", "4", "--limit", "3"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["0", "1", "2"] and records[2]["messages"][0]["content"] == "Story 2?"
    capsys.readouterr()
    assert main(["data", "regenerate", "--input", str(tmp_path / "prompts.parquet"), "--output", str(out),
                 "--limit", "0"]) == 2
    assert "--limit 0: expected a positive number" in capsys.readouterr().err


def test_dump_features_shards_index_and_lazy_reads(tmp_path, stories_file, target_and_tokenizer, capsys):
    target, tok = target_and_tokenizer
    out = tmp_path / "features"
    assert main(["data", "dump-features", "--target", "stories260K", "--data", str(stories_file), "--out", str(out),
                 "--examples-per-shard", "24", "--batch-size", "16"]) == 0
    assert "needs about" in capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    assert index["num_examples"] == 64 and len(index["shards"]) == 3
    for shard in index["shards"]:
        assert file_sha256(out / shard["file"]) == shard["sha256"]
    assert not list(out.glob("*.partial"))  # no staged file left (atomic_files)
    feats = OfflineFeatures(out)
    ds = build_dataset(stories_file, tok, "text")
    assert feats.lengths() == ds["length"]
    row = feats[30]
    ids = torch.tensor([ds[30]["input_ids"]])
    expected, logits = online_features(target, ids, torch.ones_like(ids), lambda hs: hs[-1])
    torch.testing.assert_close(row["features"], expected[0], atol=1e-5, rtol=1e-5)
    assert row["input_ids"] == ds[30]["input_ids"]
    assert index["stores_target_top1"] and torch.equal(row["target_top1"], logits[0].argmax(-1))
    shorter = min(range(64), key=lambda i: ds[i]["length"])
    batch = collate_offline([feats[30], feats[shorter]])  # right-padded, the argmax too (0 on padding)
    assert batch["target_top1"].shape == batch["input_ids"].shape
    assert torch.equal(batch["target_top1"][1, : ds[shorter]["length"]], feats[shorter]["target_top1"])
    assert not batch["target_top1"][1, ds[shorter]["length"]:].any() and ds[shorter]["length"] < ds[30]["length"]
    # a dump written before session 22 has no stored argmax: examples and batches come without it
    (out / "index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "stores_target_top1"}))
    old = OfflineFeatures(out)
    assert "target_top1" not in old[30] and "target_top1" not in collate_offline([old[30], old[shorter]])
    # a changed shard is caught by its checksum
    shard = out / index["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        OfflineFeatures(out)[0]
    with pytest.raises(IndexError, match="example 64 is outside the feature dump"):
        OfflineFeatures(out)[64]
    # a broken or foreign index, or none, is named
    (out / "index.json").write_text('{"format": ')
    with pytest.raises(ValueError, match=r"index\.json is not valid JSON .*dump the features again"):
        OfflineFeatures(out)
    (out / "index.json").write_text(json.dumps({"format": "safetensors-shards"}))
    with pytest.raises(ValueError, match="is not a specheads feature index \\(format='safetensors-shards'\\)"):
        OfflineFeatures(out)
    (out / "index.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no index.json; write one with `specheads data dump-features`"):
        OfflineFeatures(out)


def test_lookup_corpus_holds_each_answer_with_its_header(tmp_path, chat_file, target_and_tokenizer, capsys):
    """`specheads data lookup-corpus`: every assistant turn (2 conversations, 3 answers), as training tokenizes it,
    with the 3 tokens before it."""
    from specheads.inference.corpus_lookup import CorpusLookup, answer_spans

    _, tokenizer = target_and_tokenizer
    assert main(["data", "lookup-corpus", "--target", "stories260K", "--data", str(chat_file),
                 "--out", str(tmp_path / "corpus")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    dataset = build_dataset(chat_file, tokenizer)
    expected = [s for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]) for s in answer_spans(ids, mask)]
    assert summary["answers"] == len(expected) == 3 and summary["tokens"] == sum(map(len, expected))
    loaded = CorpusLookup.load(tmp_path / "corpus")
    assert loaded.base.tokens.tolist() == [t for span in expected for t in [*span, -1]]
    cat = tokenizer("Once upon a time there was a", add_special_tokens=False).input_ids
    assert loaded.guesses(cat, 3) == [tokenizer(" cat.", add_special_tokens=False).input_ids[:3]]
