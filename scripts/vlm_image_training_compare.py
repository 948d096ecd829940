"""Heads for a vision-language target trained with their records' images read vs on the same records as text.

Builds image conversations from a text corpus (each record: one of a few random pictures, then the text's first
words as the question and the rest as the answer), trains EAGLE heads on them twice (images read by the target;
images left out), and prints the mean tokens accepted per round after prompts with pictures neither run trained on
(outputs checked identical to the target's greedy `generate`).

    python scripts/vlm_image_training_compare.py --target VLM_FOLDER --texts stories.jsonl --out /tmp/compare

VLM_FOLDER: a vision-language checkpoint with its processor (the test suite's `story_vlm_dir`: stories260K behind a
tiny CLIP tower). texts: JSONL records with a "text" field (`specheads data regenerate --stories N`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from specheads import SpeculativeLM, load_heads, load_target
from specheads.cli import main as cli
from specheads.inference.multimodal import image_prompt

REPO = Path(__file__).resolve().parents[1]


def picture(path: Path, seed: int, size: int) -> Path:
    Image.fromarray((np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8")).save(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--texts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--train-images", type=int, default=4)
    p.add_argument("--test-images", type=int, default=8)
    p.add_argument("--image-size", type=int, default=16)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images = [picture(out / f"{k}.png", k, args.image_size) for k in range(args.train_images + args.test_images)]
    with_images, as_text = [], []
    for n, line in enumerate(Path(args.texts).read_text().splitlines()):
        words = json.loads(line)["text"].split(" ")
        answer = {"from": "gpt", "value": " " + " ".join(words[4:])}
        with_images.append({"image": images[n % args.train_images].name, "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(words[:4])}, answer]})
        as_text.append({"conversations": [{"from": "human", "value": " ".join(words[:4])}, answer]})
    target, _ = load_target(args.target)
    for name, records in (("images", with_images), ("text", as_text)):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        if not (out / name / "final").exists():
            assert cli(["train", str(REPO / "configs/train/eagle_stories260k.yaml"), f"target={args.target}",
                        f"data.source={data}", "data.format=auto", "data.max_length=96", f"max_steps={args.steps}",
                        f"save_steps={args.steps}", "optim.learning_rate=0.01", f"output_dir={out / name}",
                        "trackers=[]", "global_batch_size=8", "micro_batch_size=4", "optim.warmup_steps=2"]) == 0
        lm = SpeculativeLM(target, load_heads(out / name / "final", target=target).eval(), tree_depth=5, tree_top_k=4,
                           tree_num_nodes=16)
        taus = []
        for image in images[args.train_images:]:
            ids, inputs, _ = image_prompt(args.target, "Once upon a time", [str(image)])
            expected = target.generate(input_ids=ids, **inputs, max_new_tokens=64, do_sample=False)
            assert torch.equal(lm.generate(ids, max_new_tokens=64, **inputs), expected)
            taus.append(lm.last_stats["mean_accepted"])
        print(json.dumps({"heads_trained": f"with {name}" if name == "images" else "as text",
                          "mean_tau_after_an_image": round(float(np.mean(taus)), 3), "per_image": [round(t, 2) for t in taus]}))


if __name__ == "__main__":
    main()
