"""Heads for a vision-language target trained on text alone: the LLaVA around stories260K (`story_vlm_dir`) is
trained on stories, like any causal LM target; the heads then draft after a prompt that holds an image, with the
target's own greedy output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from specheads import SpeculativeLM, create_heads, load_heads, load_target
from specheads.cli import main
from specheads.inference.multimodal import image_prompt

from .conftest import CONFIGS, overrides

pytestmark = pytest.mark.slow


def test_text_trained_heads_draft_after_an_image(tmp_path, stories_file, story_vlm_dir):
    out = tmp_path / "run"
    extra = {"target": str(story_vlm_dir), "max_steps": 100, "save_steps": 100, "optim.learning_rate": 0.01}
    assert main(["train", str(CONFIGS / "eagle_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    target, _ = load_target(story_vlm_dir)
    trained = load_heads(out / "final", target=target)
    assert trained.config.target_architectures == ["LlavaForConditionalGeneration"]
    image = tmp_path / "a.png"
    Image.fromarray((np.random.default_rng(0).random((16, 16, 3)) * 255).astype("uint8")).save(image)
    input_ids, inputs, _ = image_prompt(str(story_vlm_dir), "Once upon a time there was a", [str(image)])
    expected = target.generate(input_ids=input_ids, **inputs, max_new_tokens=64, do_sample=False)
    taus = {}
    for name, heads in (("trained", trained), ("fresh", create_heads(target, "eagle"))):
        lm = SpeculativeLM(target, heads.eval(), tree_depth=5, tree_top_k=4, tree_num_nodes=16)
        assert torch.equal(lm.generate(input_ids, max_new_tokens=64, **inputs), expected)
        taus[name] = lm.last_stats["mean_accepted"]
    assert taus["trained"] > 1.8 and taus["trained"] > taus["fresh"] + 0.5, taus
