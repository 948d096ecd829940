"""Training heads for a hybrid target (Qwen3.5: Gated DeltaNet beside attention) through the command line: its
answers regenerated, its features dumped, a run online and one offline, and the heads decoding it exactly."""

from __future__ import annotations

import json

import torch

from specheads import SpeculativeLM, load_heads
from specheads.cli import main

from ..conftest import build_tiny_target
from .conftest import CONFIGS, overrides


def test_heads_for_a_hybrid_target_train_from_the_command_line(tmp_path, stories_file, target_and_tokenizer):
    _, tokenizer = target_and_tokenizer  # stories260K's tokenizer, for a random Qwen3.5 of its vocabulary
    target = build_tiny_target("qwen3_5_text", vocab_size=512, eos_token_id=None)
    folder = tmp_path / "qwen3_5"
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    answers = tmp_path / "answers.jsonl"
    assert main(["data", "regenerate", "--target", str(folder), "--stories", "16", "--max-new-tokens", "24",
                 "--output", str(answers)]) == 0
    assert len(answers.read_text().splitlines()) == 16
    config = str(CONFIGS / "eagle3_stories260k.yaml")
    online = overrides(answers, tmp_path / "online", max_steps=4, save_steps=4, target=str(folder),
                       **{"head.options": "{draft_vocab_size: 128}"})
    assert main(["train", config, *online]) == 0
    assert main(["data", "dump-features", "--target", str(folder), "--data", str(answers), "--out",
                 str(tmp_path / "features"), "--max-length", "64", "--head-type", "eagle3"]) == 0
    offline = overrides(answers, tmp_path / "offline", max_steps=4, save_steps=4, target=str(folder),
                        feature_mode="offline", **{"data.features_dir": str(tmp_path / "features"),
                                                   "head.options": "{draft_vocab_size: 128}"})
    assert main(["train", config, *offline]) == 0
    assert '"acc_depth1"' in (tmp_path / "offline" / "metrics.json").read_text()
    for run in ("online", "offline"):
        heads = load_heads(tmp_path / run / "final", target=target)
        lm = SpeculativeLM(target, heads, tokenizer=tokenizer)
        ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
        assert lm.tree_description()["chain"]
        assert torch.equal(lm.generate(ids, max_new_tokens=16), target.generate(ids, max_new_tokens=16, do_sample=False))
    assert json.loads((tmp_path / "online" / "final" / "config.json").read_text())["head_type"] == "eagle3"
