"""Fine-tuning a target's MTP layer (`specheads train head.type=mtp`): it starts from the layer the target ships,
learns the target's answers, saves as a specheads checkpoint and drafts exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads import SpeculativeLM, create_heads, load_heads, load_target
from specheads.cli import main

from ..inference.conftest import hf_greedy
from ..mtp_targets import load_mtp_target, write_mtp_target
from .conftest import REPO, assert_two_processes_train_like_one, depth1_accuracy, overrides

pytestmark = pytest.mark.slow
STORIES = Path(__file__).resolve().parents[2] / "specheads" / "assets" / "stories260K"


def test_fine_tuning_the_mtp_layer_learns_and_drafts_exactly(tmp_path, stories_file):
    folder = write_mtp_target(tmp_path / "target", "deepseek_v3", vocab_size=512, tokenizer_from=STORIES)
    target = load_mtp_target(folder)
    out = tmp_path / "run"
    extra = {"target": str(folder), "head.type": "mtp", "max_steps": 30, "save_steps": 15,
             "optim.learning_rate": 0.003, "loss.eval_depth": 2}
    assert main(["train", str(Path(__file__).parents[2] / "configs/train/eagle_stories260k.yaml"),
                 *overrides(stories_file, out, **extra)]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 30
    trained = load_heads(out / "final", target=target)
    assert trained.config.head_type == "mtp" and trained.config.draft_layer_config["model_type"] == "deepseek_v3"
    shipped = create_heads(target, "mtp")  # the layer as the target ships it: where the run started
    _, tokenizer = load_target(str(folder))
    after, before = (depth1_accuracy(h, target, tokenizer, stories_file) for h in (trained, shipped))
    assert after > before + 0.1, (after, before)
    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = SpeculativeLM(target, trained)
    assert torch.equal(lm.generate(prompt, max_new_tokens=24), hf_greedy(target, prompt, 24))


def test_a_qwen3_next_mtp_layer_fine_tunes_on_its_hybrid_target(tmp_path, stories_file):
    """The `mtp.*` layer of a Qwen3-Next target (heads/checkpoint_mtp.py) fine-tunes online, its target verified by
    chains, with a draft vocabulary of the data's 96 most frequent tokens chosen by the run."""
    folder = write_mtp_target(tmp_path / "target", "qwen3_next", vocab_size=512, tokenizer_from=STORIES)
    out = tmp_path / "run"
    extra = {"target": str(folder), "head.type": "mtp", "max_steps": 4, "save_steps": 4,
             "head.options.eagle_draft_vocab_size": 96}
    assert main(["train", str(Path(__file__).parents[2] / "configs/train/eagle_stories260k.yaml"),
                 *overrides(stories_file, out, **extra)]) == 0
    target = load_mtp_target(folder)
    trained, shipped = load_heads(out / "final", target=target), create_heads(target, "mtp")
    assert trained.config.draft_layer_config["model_type"] == "qwen3_next" and trained.draft_vocab_size == 96
    assert json.loads((out / "metrics.json").read_text())["draft_vocab_coverage"] > 0.5
    assert not torch.equal(trained.d2t.cpu(), torch.arange(96))  # the data's tokens, not the first ids
    assert any(not torch.equal(trained.state_dict()[name], value) for name, value in shipped.state_dict().items())
    _, tokenizer = load_target(str(folder))
    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert torch.equal(SpeculativeLM(target, trained).generate(prompt, max_new_tokens=16), hf_greedy(target, prompt, 16))


def test_a_draft_vocabulary_for_the_targets_own_mtp_layer(tmp_path, stories_file, capsys):
    """`data draft-vocab --heads mtp --target T`: a copy of the shipped layer that scores drafts over the data's most
    frequent tokens only (those columns of its logits), and decodes exactly."""
    folder = write_mtp_target(tmp_path / "target", "qwen3_5_text", vocab_size=512, tokenizer_from=STORIES)
    out = tmp_path / "mtp-96"
    assert main(["data", "draft-vocab", "--heads", "mtp", "--target", str(folder), "--data", str(stories_file),
                 "--size", "96", "--out", str(out), "--max-length", "64"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["coverage"] > 0.5
    target = load_mtp_target(folder)
    reduced, shipped = load_heads(out, target=target), create_heads(target, "mtp")
    assert reduced.draft_vocab_size == 96 and reduced.d2t.tolist() == sorted(set(reduced.d2t.tolist()))
    assert all(torch.equal(value, shipped.state_dict()[name]) for name, value in reduced.state_dict().items()
               if name != "d2t")
    features, ids = torch.randn(1, 3, 64), torch.tensor([[5, 6, 7]])
    mask = torch.full((1, 1, 3, 3), torch.finfo(torch.float32).min).triu(1)
    with torch.no_grad():
        hidden = reduced(features, ids, torch.arange(3)[None], mask)
        torch.testing.assert_close(reduced.draft_logits(hidden), reduced.logits(hidden)[..., reduced.d2t])
    _, tokenizer = load_target(str(folder))
    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert torch.equal(SpeculativeLM(target, reduced).generate(prompt, max_new_tokens=16), hf_greedy(target, prompt, 16))
    assert main(["data", "draft-vocab", "--heads", "mtp", "--data", str(stories_file), "--size", "96",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--heads mtp drafts with the target's own MTP layer: name the target with --target" in capsys.readouterr().err


def test_mtp_layers_train_on_offline_features(tmp_path, stories_file):
    """`data dump-features --head-type mtp` stores the final states the MTP layer reads; a run on them trains."""
    folder = write_mtp_target(tmp_path / "target", "glm4_moe", vocab_size=512, tokenizer_from=STORIES)
    features = tmp_path / "features"
    assert main(["data", "dump-features", "--target", str(folder), "--data", str(stories_file), "--format", "text",
                 "--max-length", "64", "--out", str(features), "--head-type", "mtp"]) == 0
    out = tmp_path / "run"
    extra = {"target": str(folder), "head.type": "mtp", "feature_mode": "offline", "data.features_dir": str(features),
             "max_steps": 24, "optim.learning_rate": 0.003}
    assert main(["train", str(Path(__file__).parents[2] / "configs/train/eagle_stories260k.yaml"),
                 *overrides(stories_file, out, **extra)]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 24
    target = load_mtp_target(folder)
    _, tokenizer = load_target(str(folder))
    trained, shipped = load_heads(out / "final", target=target), create_heads(target, "mtp")
    after, before = (depth1_accuracy(h, target, tokenizer, stories_file) for h in (trained, shipped))
    assert after > before + 0.05, (after, before)


def test_two_processes_fine_tune_an_mtp_layer_as_one(tmp_path, stories_file):
    """DDP over a mixture-of-experts MTP layer (experts a batch never routes to included) equals one process."""
    folder = write_mtp_target(tmp_path / "target", "deepseek_v3", vocab_size=512, tokenizer_from=STORIES)
    common = {"target": str(folder), "head.type": "mtp", "max_steps": 4, "save_steps": 4, "global_batch_size": 8,
              "micro_batch_size": 2, "optim.learning_rate": 0.003}
    assert_two_processes_train_like_one(str(REPO / "configs/train/eagle_stories260k.yaml"), stories_file, tmp_path,
                                        port=29563, common=common)
