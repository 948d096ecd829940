"""Heads for a vision-language target: the LLaVA around stories260K (`story_vlm_dir`) trained on stories as text,
like any causal LM target, and on stories that open with an image (the target reads the image while making the
features, online or in a feature dump); the heads then draft after a prompt that holds an image, with the target's
own greedy output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from specheads import SpeculativeLM, create_heads, load_heads, load_target
from specheads.cli import main
from specheads.inference.multimodal import image_prompt
from specheads.training.data import build_dataset
from specheads.training.features import OfflineFeatures, target_states
from specheads.training.image_records import ImageCollate

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
    taus = taus_after_an_image(target, trained, story_vlm_dir, "Once upon a time there was a", image)
    assert taus["trained"] > 1.8 and taus["trained"] > taus["fresh"] + 0.5, taus


def taus_after_an_image(target, trained, story_vlm_dir, question: str, image) -> dict[str, float]:
    """Tokens accepted per round by the trained heads and by fresh ones, 64 new tokens after a prompt with `image`
    (each output checked identical to the target's own greedy `generate`)."""
    input_ids, inputs, _ = image_prompt(str(story_vlm_dir), question, [str(image)])
    expected = target.generate(input_ids=input_ids, **inputs, max_new_tokens=64, do_sample=False)
    taus = {}
    for name, heads in (("trained", trained), ("fresh", create_heads(target, "eagle"))):
        lm = SpeculativeLM(target, heads.eval(), tree_depth=5, tree_top_k=4, tree_num_nodes=16)
        assert torch.equal(lm.generate(input_ids, max_new_tokens=64, **inputs), expected)
        taus[name] = lm.last_stats["mean_accepted"]
    return taus


def image_story_chats(stories_file, folder, images: int = 4):
    """The stories as conversations that open with an image (one of `images` random pictures, LLaVA's `<image>`
    placeholder): the user turn is the story's first four words, the answer the rest."""
    for k in range(images):
        pixels = (np.random.default_rng(k).random((16, 16, 3)) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / f"{k}.png")
    records = []
    for n, line in enumerate(stories_file.read_text().splitlines()):
        words = json.loads(line)["text"].split(" ")
        records.append({"image": f"{n % images}.png", "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(words[:4])},
            {"from": "gpt", "value": " " + " ".join(words[4:])}]})
    path = folder / "image_stories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_heads_trained_on_image_records_draft_after_an_image(tmp_path, stories_file, story_vlm_dir):
    """Online training reads each record's image; the heads then draft after an image prompt (outputs identical)."""
    chats = image_story_chats(stories_file, tmp_path)
    out = tmp_path / "run"
    extra = {"target": str(story_vlm_dir), "data.source": str(chats), "data.format": "auto", "data.max_length": 96,
             "max_steps": 100, "save_steps": 100, "optim.learning_rate": 0.01, "data.eval_fraction": 0.125}
    assert main(["train", str(CONFIGS / "eagle_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_tokens"] > 0  # held-out image rows were scored (their images read as well)
    target, _ = load_target(story_vlm_dir)
    trained = load_heads(out / "final", target=target)
    taus = taus_after_an_image(target, trained, story_vlm_dir, "Once upon a time", tmp_path / "1.png")
    assert taus["trained"] > 1.8 and taus["trained"] > taus["fresh"] + 0.5, taus


def test_feature_dump_cli_reads_the_images_and_offline_training_runs(tmp_path, stories_file, story_vlm_dir, capsys):
    (tmp_path / "data").mkdir()
    chats = image_story_chats(stories_file, tmp_path / "data")
    dump = tmp_path / "dump"
    assert main(["data", "dump-features", "--target", str(story_vlm_dir), "--data", str(chats), "--out", str(dump),
                 "--max-length", "96", "--batch-size", "16"]) == 0
    features = OfflineFeatures(dump)
    image_id = load_target(story_vlm_dir)[0].config.image_token_id
    assert len(features) == 64 and all(features[i]["input_ids"].count(image_id) == 16 for i in (0, 63))
    # the same rows online: the dump holds the image-conditioned final states
    target, tokenizer = load_target(story_vlm_dir)
    processor = AutoProcessor.from_pretrained(story_vlm_dir)
    dataset = build_dataset(chats, tokenizer, max_length=96, processor=processor)
    batch = ImageCollate(processor)([dataset[0]])
    states, _ = target_states(target, batch["input_ids"], batch["attention_mask"], batch["row_inputs"])
    torch.testing.assert_close(features[0]["features"], states[-1][0])
    out = tmp_path / "run"
    extra = {"target": str(story_vlm_dir), "feature_mode": "offline", "data.features_dir": str(dump), "max_steps": 4,
             "save_steps": 4}
    assert main(["train", str(CONFIGS / "eagle_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("config", ["medusa_stories260k.yaml", "eagle3_stories260k.yaml"])
def test_every_head_type_trains_on_image_records(tmp_path, stories_file, story_vlm_dir, config):
    chats = image_story_chats(stories_file, tmp_path)
    out = tmp_path / "run"
    extra = {"target": str(story_vlm_dir), "data.source": str(chats), "data.format": "auto", "data.max_length": 96,
             "max_steps": 3, "save_steps": 3}
    assert main(["train", str(CONFIGS / config), *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["loss"] > 0
