"""On-policy distillation (training/on_policy.py): batches of the draft model's own answers, seeded, resumable."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from specheads.cli import main
from specheads.training.config import load_run_config
from specheads.training.on_policy import draft_answers, is_on_policy_step

from .conftest import CONFIGS, overrides

RECIPE = str(CONFIGS / "distill_stories260k.yaml")


def chat_batch() -> dict[str, torch.Tensor]:
    """Three right-padded rows: prompt + answer, prompt + longer answer, and one with nothing trained."""
    rows = [([1, 5, 6, 7, 20, 21, 22], [0, 0, 0, 0, 1, 1, 1]),
            ([1, 9, 30, 31, 32, 33, 34, 35, 36], [0, 0, 1, 1, 1, 1, 1, 1, 1]),
            ([1, 8, 8], [0, 0, 0])]
    width = max(len(ids) for ids, _ in rows)
    batch = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in ("input_ids", "attention_mask", "loss_mask")}
    for b, (ids, mask) in enumerate(rows):
        batch["input_ids"][b, :len(ids)] = torch.tensor(ids)
        batch["attention_mask"][b, :len(ids)] = 1
        batch["loss_mask"][b, :len(ids)] = torch.tensor(mask)
    return batch


def test_draft_answers_replace_the_answers_only(target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    draft = copy.deepcopy(target).train()
    batch = chat_batch()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    out = draft_answers(draft, batch, pad_token_id=0, temperature=1.0, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # the run's own random state is untouched
    assert draft.training  # put back in training mode
    eos = target.generation_config.eos_token_id
    for b, (prompt_length, answer_length) in enumerate([(4, 3), (2, 7)]):
        length = int(out["attention_mask"][b].sum())
        ids, mask = out["input_ids"][b, :length].tolist(), out["loss_mask"][b, :length].tolist()
        assert ids[:prompt_length] == batch["input_ids"][b, :prompt_length].tolist()  # the prompt kept
        answer = ids[prompt_length:]
        assert mask == [0] * prompt_length + [1] * len(answer)
        assert 1 <= len(answer) <= answer_length and (len(answer) == answer_length or answer[-1] == eos)
    assert out["input_ids"][2, :3].tolist() == [1, 8, 8] and out["loss_mask"][2].sum() == 0  # nothing to answer
    again = draft_answers(draft, batch, pad_token_id=0, temperature=1.0, seed=7)
    assert all(torch.equal(again[k], out[k]) for k in out)  # a pure function of the seed
    others = [draft_answers(draft, batch, pad_token_id=0, temperature=1.0, seed=s)["input_ids"] for s in (8, 9)]
    assert any(not torch.equal(other, out["input_ids"]) for other in others)


def test_on_policy_steps_are_a_seeded_share():
    chosen = [is_on_policy_step(0, step, 0.3) for step in range(2000)]
    assert 0.25 < sum(chosen) / len(chosen) < 0.35
    assert chosen == [is_on_policy_step(0, step, 0.3) for step in range(2000)]
    assert not any(is_on_policy_step(0, step, 0.0) for step in range(100))
    assert all(is_on_policy_step(0, step, 1.0) for step in range(100))
    with pytest.raises(ValueError, match=r"distill.on_policy=1.5 is invalid; expected .* in \[0, 1\]"):
        load_run_config(RECIPE, ["data.source=x.jsonl", "distill.on_policy=1.5"])
    with pytest.raises(ValueError, match="distill.on_policy=0.5 is set but head.type='eagle'"):
        load_run_config(None, ["data.source=x.jsonl", "distill.on_policy=0.5"])


@pytest.mark.slow
def test_an_on_policy_distillation_resumes_exactly(tmp_path, stories_file):
    """Half the steps on the draft's own answers: logged as such, and a stop then resume ends where an uninterrupted
    run does (the samples are drawn again from the same seeds and the same checkpointed draft)."""
    steps = {"max_steps": 6, "save_steps": 3, "distill.on_policy": 0.5, "eval_steps": 0}
    assert main(["train", RECIPE, *overrides(stories_file, tmp_path / "ref", **steps)]) == 0
    out = tmp_path / "stopped"
    assert main(["train", RECIPE, *overrides(stories_file, out, stop_after_steps=3, **steps)]) == 0
    assert main(["train", RECIPE, *overrides(stories_file, out, **steps)]) == 0
    ref, got = load_file(tmp_path / "ref" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert sum(is_on_policy_step(0, step, 0.5) for step in range(6)) > 0  # the seed-0 run had on-policy steps
