"""`specheads data synth-prompts`: the target writes user prompts (Magpie), filtered, resumable, benchmark-free."""

from __future__ import annotations

import copy
import json
import re

import pytest

from specheads.cli import main
from specheads.training import synth_prompts
from specheads.training.synth_prompts import PromptFilter, synthesize_prompts, user_turn_prefix

# stories260K has no chat template. Its stories end with a BOS token (how llama2.c separates them), so a template
# whose user turn ends with BOS gives the model a turn it can finish.
USER_TURN_ENDS_WITH_BOS = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ bos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FAST = dict(batch_size=16, max_new_tokens=256, seed=3, show_progress=False)


@pytest.fixture(scope="module")
def chat_stories(target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = USER_TURN_ENDS_WITH_BOS
    return target, tokenizer


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prefix_is_the_template_up_to_the_user_message(chat_stories):
    _, tok = chat_stories
    prefix, end_of_turn = user_turn_prefix(tok)
    assert tok.decode(prefix).strip() == "<|user|>"
    assert end_of_turn == tok.bos_token_id
    prefix, _ = user_turn_prefix(tok, system="Be brief.")
    assert tok.decode(prefix).replace(" ", "") == "<|system|>Bebrief.<s><|user|>"


def test_templates_it_cannot_use_are_refused_by_name(target_and_tokenizer):
    _, tok = target_and_tokenizer
    with pytest.raises(ValueError, match="needs a chat template"):
        user_turn_prefix(tok)
    plain = copy.deepcopy(tok)
    plain.chat_template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not start with a special token"):
        user_turn_prefix(plain)


def test_filter_drops_unfinished_short_repeated_and_benchmark_prompts():
    bench = {"Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."}
    keep = PromptFilter(bench, min_chars=10, overlap_words=8)
    assert keep.reject_reason("Explain photosynthesis to a child.", finished=False) == "unfinished"
    assert keep.reject_reason("Hi there", finished=True) == "short"
    assert keep.reject_reason("Explain photosynthesis to a child.", finished=True) is None
    keep.remember("Explain photosynthesis to a child.")
    assert keep.reject_reason("explain  photosynthesis to a CHILD.", finished=True) == "duplicate"
    assert keep.reject_reason(next(iter(bench)).upper(), finished=True) == "benchmark"
    quoting = "Please: compose an engaging travel blog post about a recent trip to Rome."  # 8 words of it in a row
    assert keep.reject_reason(quoting, finished=True) == "benchmark"
    assert keep.reject_reason("Write a travel blog post about my recent trip to Rome.", finished=True) is None  # 7 at most
    with pytest.raises(ValueError, match="overlap_words=0"):
        PromptFilter(overlap_words=0)


def test_synthesized_prompts_are_kept_by_the_filter_and_resume_exactly(tmp_path, chat_stories):
    target, tok = chat_stories
    full, part, longer = tmp_path / "full.jsonl", tmp_path / "part.jsonl", tmp_path / "longer.jsonl"
    summary = synthesize_prompts(target, tok, full, 6, **FAST)
    records = read(full)
    assert summary["kept"] == summary["written"] == len(records) == 6
    assert summary["generated"] == 6 + sum(summary["rejected"].values())
    assert summary["rejected"].get("unfinished", 0) > 0  # the filter did work: stories that ran past 256 tokens
    texts = [r["messages"][0]["content"] for r in records]
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in records)
    assert len({" ".join(t.lower().split()) for t in texts}) == 6 and min(len(t) for t in texts) >= 16
    assert all("<s>" not in t and "<|user|>" not in t for t in texts)  # the message only, no template tokens

    # killed while writing the 4th record: the resumed run writes the same file
    lines = full.read_text().splitlines()
    part.write_text("\n".join(lines[:3]) + "\n" + lines[3][:15])
    assert synthesize_prompts(target, tok, part, 6, **FAST)["written"] == 3
    assert part.read_text() == full.read_text()
    assert synthesize_prompts(target, tok, part, 6, **FAST)["written"] == 0  # done: nothing more
    # asked for more, it writes what one run asked for that many writes
    assert synthesize_prompts(target, tok, full, 9, **FAST)["written"] == 3
    synthesize_prompts(target, tok, longer, 9, **FAST)
    assert full.read_text() == longer.read_text() and read(longer)[:6] == records


def test_benchmark_prompts_never_come_out(tmp_path, chat_stories):
    target, tok = chat_stories
    first = tmp_path / "first.jsonl"
    synthesize_prompts(target, tok, first, 4, **FAST)
    texts = [r["messages"][0]["content"] for r in read(first)]
    bench = tmp_path / "bench.jsonl"  # MT-bench format: one prompt verbatim, one quoted 8 words in a row
    quoted = " ".join(re.findall(r"\w+", texts[1])[:8])
    assert len(quoted.split()) == 8
    bench.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": [texts[0]]}) + "\n"
                     + json.dumps({"question_id": 2, "category": "writing", "turns": [f"Say: {quoted}"]}) + "\n")
    second = tmp_path / "second.jsonl"
    summary = synthesize_prompts(target, tok, second, 4, exclude=bench, **FAST)
    kept = [r["messages"][0]["content"] for r in read(second)]
    assert summary["rejected"]["benchmark"] >= 2
    assert texts[0] not in kept and texts[1] not in kept and kept[:2] == texts[2:4]


def test_openings_start_the_messages_and_the_model_writes_on_from_them(tmp_path, chat_stories, monkeypatch):
    target, tok = chat_stories
    openings = ["Lily found a shiny", "Tom and his dog"]
    steered, plain = tmp_path / "steered.jsonl", tmp_path / "plain.jsonl"
    synthesize_prompts(target, tok, steered, 6, openings=openings, **FAST)
    synthesize_prompts(target, tok, plain, 6, **FAST)
    plain_by_id = {r["id"]: r["messages"][0]["content"] for r in read(plain)}
    steered_records = read(steered)
    assert len(steered_records) == 6
    for record in steered_records:
        row = int(record["id"].rsplit("-", 1)[1])
        text = record["messages"][0]["content"]
        assert text.startswith(openings[row % 2])  # row r of a batch starts with opening r mod 2
        # the model wrote on from the opening: not the unsteered message of the same batch and row behind it
        if record["id"] in plain_by_id:
            assert text[len(openings[row % 2]):].strip() != plain_by_id[record["id"]]
    assert {r["messages"][0]["content"].startswith(openings[0]) for r in steered_records} == {True, False}
    # a model that ends its message right after the opening wrote no prompt
    stop = tok.bos_token_id
    story = tok("Lily found a shiny red ball in the park.", add_special_tokens=False).input_ids
    monkeypatch.setattr(synth_prompts, "generate_batch", lambda *a, **k: [[stop], story + [stop]])
    summary = synthesize_prompts(target, tok, tmp_path / "bare.jsonl", 1, openings=["Write a long story about"],
                                 batch_size=2, show_progress=False)
    assert summary["rejected"] == {"short": 1} and summary["kept"] == 1
    assert read(tmp_path / "bare.jsonl")[0]["messages"][0]["content"].startswith("Write a long story about Lily")
    with pytest.raises(ValueError, match="opening=' '"):
        synthesize_prompts(target, tok, tmp_path / "z.jsonl", 2, openings=["Tom", " "], show_progress=False)


def test_a_target_that_never_finishes_a_turn_is_stopped_with_a_reason(tmp_path, chat_stories):
    target, tok = chat_stories
    with pytest.raises(RuntimeError, match="no prompt worth keeping.*unfinished"):
        synthesize_prompts(target, tok, tmp_path / "x.jsonl", 2, batch_size=2, max_new_tokens=2, show_progress=False)
    for bad, message in ((dict(count=0), "count=0"), (dict(temperature=0.0), "temperature=0.0")):
        with pytest.raises(ValueError, match=message):
            synthesize_prompts(target, tok, tmp_path / "y.jsonl", **{"count": 2, **bad})


def test_cli_writes_prompts_regenerate_can_answer(tmp_path, chat_stories, capsys):
    target, tok = chat_stories
    folder = tmp_path / "chat-stories"
    target.save_pretrained(folder)
    tok.save_pretrained(folder)
    prompts, answers = tmp_path / "synth.jsonl", tmp_path / "answers.jsonl"
    assert main(["data", "synth-prompts", "--target", str(folder), "--count", "3", "--output", str(prompts),
                 "--batch-size", "16", "--max-new-tokens", "256", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["kept"] == 3 and len(read(prompts)) == 3
    assert "no --exclude given" in captured.err  # nothing kept benchmark prompts out: the user is told
    assert main(["data", "regenerate", "--target", str(folder), "--input", str(prompts), "--output", str(answers),
                 "--max-new-tokens", "8", "--batch-size", "4"]) == 0
    answered = read(answers)
    assert [r["messages"][0] for r in answered] == [r["messages"][0] for r in read(prompts)]
    assert all(r["messages"][-1]["role"] == "assistant" for r in answered)
    steered = tmp_path / "steered.jsonl"
    assert main(["data", "synth-prompts", "--target", str(folder), "--count", "2", "--output", str(steered),
                 "--batch-size", "16", "--seed", "3", "--max-new-tokens", "256",
                 "--opening", "Lily found a shiny", "--opening", "Tom and his dog"]) == 0
    assert all(r["messages"][0]["content"].startswith(("Lily found a shiny", "Tom and his dog")) for r in read(steered))
    capsys.readouterr()
    assert main(["data", "synth-prompts", "--target", "stories260K", "--count", "2", "--output", str(tmp_path / "z.jsonl")]) == 2
    assert "synthesizing prompts needs a chat template" in capsys.readouterr().err
    # a blank opening is named before any model loads (this target folder does not even exist)
    assert main(["data", "synth-prompts", "--target", str(tmp_path / "missing"), "--count", "2", "--output", str(tmp_path / "z.jsonl"),
                 "--opening", "Write a", "--opening", ""]) == 2
    assert "opening=''" in capsys.readouterr().err
