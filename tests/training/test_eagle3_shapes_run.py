"""A training run of EAGLE-3 heads narrower than the target and of two decoder layers (`head.options`
`draft_hidden_size`, `num_layers`)."""

from __future__ import annotations

import pytest
import torch

from specheads import SpeculativeLM, load_heads
from specheads.cli import main
from specheads.heads.describe import describe_heads
from specheads.training.config import load_run_config
from specheads.training.train import initial_heads

from .conftest import CONFIGS, overrides


def test_a_training_run_makes_narrow_two_layer_heads_that_learn_load_and_decode(tmp_path, stories_file, target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    config = str(CONFIGS / "eagle3_stories260k.yaml")
    run = overrides(stories_file, tmp_path / "run", max_steps=12, save_steps=12, **{
        "head.options": "{draft_hidden_size: 32, num_layers: 2, draft_vocab_size: 128, feature_layers: [1, 3, 4]}",
        "loss.ttt_steps": 2})
    assert main(["train", config, *run]) == 0
    final = tmp_path / "run" / "final"
    metrics = (tmp_path / "run" / "metrics.json").read_text()
    heads = load_heads(final, target=target)
    assert heads.config.draft_hidden_size == 32 and heads.embed_tokens.weight.shape == (512, 32)
    assert heads.config.num_layers == 2 and len(heads.extra_layers) == 1
    assert '"acc_depth1"' in metrics
    summary = describe_heads(final)
    assert (summary["hidden_size"], summary["draft_hidden_size"]) == (64, 32)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, heads)
    assert torch.equal(lm.generate(ids, max_new_tokens=24), target.generate(ids, max_new_tokens=24, do_sample=False))
    assert lm.last_stats["mean_accepted"] > 1  # trained for 12 steps, the narrow heads already guess right
    # more training on these heads keeps their shape; asking for another width is refused by name
    again = load_run_config(config, overrides(stories_file, tmp_path / "again", init_heads=str(final),
                                              **{"head.options": "{draft_hidden_size: 48}"}))
    with pytest.raises(ValueError, match="head.options.draft_hidden_size=48 but init_heads=.* has draft_hidden_size=32"):
        initial_heads(again, target)
