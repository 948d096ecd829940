"""The heads committed under checkpoints/ load, match their target's shape, and stay within the size budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads import load_heads

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@pytest.mark.parametrize(
    "name, head_type, steps, min_acc",
    [
        ("smollm2-135m-instruct-eagle", "eagle", 3000, 0.7),
        # trained on five times from the first EAGLE-3 heads (init_heads): every ShareGPT turn (37,227 greedy
        # answers), 17,920 sampled ones (temperature 0.7), then greedy answers to prompts SmolLM2 wrote (7,934,
        # then 18,234)
        ("smollm2-135m-instruct-eagle3", "eagle3", 2729, 0.6),
    ],
)
def test_committed_heads_load_and_fit_the_budget(name, head_type, steps, min_acc):
    folder = CHECKPOINTS / name
    heads = load_heads(folder)  # strict: every tensor present, none extra, shapes as the config says
    config = heads.config
    assert (config.head_type, config.hidden_size, config.vocab_size) == (head_type, 576, 49152)
    assert config.target_name_or_path == "smollm2-135m-instruct"
    assert len(config.target_embedding_sample) == 16  # refuses a same-shaped other target
    # drafts over its 8,192 most frequent trained tokens; the special tokens (0-2, EOS = 2) are always draftable
    assert heads.draft_vocab_size == 8192 and bool(torch.isin(torch.tensor([0, 1, 2]), heads.d2t).all())
    assert (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    metrics = json.loads((folder / "training_metrics.json").read_text())
    assert metrics["steps"] == steps and metrics["acc_depth1"] > min_acc
    assert "How these heads were trained" in (folder / "README.md").read_text()
    # a CPU target drafts the small tree measured fastest there (docs/results.md, "Default tree on a CPU")
    assert config.tree_defaults("cpu") == {"tree_depth": 4, "tree_top_k": 4, "tree_num_nodes": 8, "tree_stop_prob": 0.2,
                                           "tree_min_prob": 0.03, "static_tree": config.static_tree}
    assert (config.tree_defaults("cuda")["tree_depth"], config.tree_defaults("cuda")["tree_num_nodes"]) == (5, 24)
