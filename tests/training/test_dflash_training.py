"""DFlash heads train through the CLI (online and from a feature dump, alike), learn, and refuse bad settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads import create_heads, load_heads
from specheads.cli import main
from specheads.training.config import load_run_config

from .conftest import (
    CONFIGS,
    assert_offline_trains_like_online,
    assert_two_processes_train_like_one,
    depth1_accuracy,
    dump_features,
    overrides,
)

pytestmark = pytest.mark.slow
CONFIG = CONFIGS / "dflash_stories260k.yaml"


def test_a_short_run_learns_and_its_heads_draft(tmp_path, stories_file, target_and_tokenizer):
    target, tok = target_and_tokenizer
    out = tmp_path / "dflash"
    extra = {"max_steps": 80, "save_steps": 80, "head.options.num_layers": 1}
    assert main(["train", str(CONFIG), *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 80 and {"acc_depth1", "acc_depth7", "sim_tau", "blocks"} <= set(metrics)
    trained = load_heads(out / "final", target=target)
    assert trained.config.head_type == "dflash" and trained.config.feature_layers == [1, 3, 4]
    torch.manual_seed(0)
    fresh = create_heads(target, "dflash", **{**load_run_config(CONFIG).head.options, "num_layers": 1})
    acc_trained, acc_fresh = depth1_accuracy(trained, target, tok, stories_file), depth1_accuracy(fresh, target, tok, stories_file)
    assert acc_trained > acc_fresh + 0.1, (acc_trained, acc_fresh)
    report = tmp_path / "eval.json"  # `specheads eval`: a block at every answer position, each depth scored
    assert main(["eval", "--target", "stories260K", "--heads", str(out / "final"), "--data", str(stories_file),
                 "--limit", "8", "--out", str(report)]) == 0
    scores = json.loads(report.read_text())  # one heads: one report
    assert scores["acc_depth1"] > acc_fresh + 0.1 and "acc_depth7" in scores and scores["sim_tau"] > 1


def test_online_and_offline_features_train_alike(tmp_path, stories_file, capsys):
    """`data dump-features --head-type dflash` stores the tapped layers; a run on them equals the online run; a dump
    of other layers is refused, naming the command that makes the right one."""
    steps = {"max_steps": 6, "save_steps": 6, "head.options.num_layers": 1}

    def dump(out: Path, *extra: str) -> int:
        return dump_features(stories_file, out, *extra)

    def train(out: Path, **extra) -> int:
        return main(["train", str(CONFIG), *overrides(stories_file, out, **steps, **extra)])

    assert "fc.weight" in assert_offline_trains_like_online(str(CONFIG), "dflash", stories_file, tmp_path, steps)
    assert dump(tmp_path / "default_taps", "--head-type", "dflash") == 0  # DFlash's default taps on 5 layers
    assert json.loads((tmp_path / "default_taps" / "index.json").read_text())["tapped_layers"] == [2, 3]
    capsys.readouterr()
    assert train(tmp_path / "bad", feature_mode="offline", **{"data.features_dir": str(tmp_path / "default_taps")}) == 2
    assert "--head-type dflash --feature-layers 1,3,4" in capsys.readouterr().err


def test_a_run_builds_the_draft_vocabulary_from_its_data(tmp_path, stories_file, target_and_tokenizer):
    """`head.options.eagle_draft_vocab_size` on a DFlash run: the d2t of the most frequent trained tokens (and the
    special ones) is chosen before step 1 and saved with the heads, which then draft over it."""
    target, tok = target_and_tokenizer
    out = tmp_path / "vocab"
    extra = {"max_steps": 4, "save_steps": 4, "head.options.num_layers": 1, "head.options.eagle_draft_vocab_size": 128}
    assert main(["train", str(CONFIG), *overrides(stories_file, out, **extra)]) == 0
    heads = load_heads(out / "final", target=target)
    assert heads.draft_vocab_size == 128 and heads.d2t.shape == (128,) and bool((heads.d2t[1:] > heads.d2t[:-1]).all())
    assert set(tok.all_special_ids) <= set(heads.d2t.tolist())


def test_two_processes_train_like_one(tmp_path, stories_file):
    """DDP: each process's micro batch draws the anchors the single process draws for it (seeded by its tokens)."""
    common = {"max_steps": 4, "save_steps": 4, "head.options.num_layers": 1, "loss.dflash_blocks": 4}
    assert_two_processes_train_like_one(str(CONFIG), stories_file, tmp_path, port=29561, common=common)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="loss.dflash_blocks=-1 is invalid"):
        load_run_config(CONFIG, ["loss.dflash_blocks=-1"])
    with pytest.raises(ValueError, match="loss.dflash_gamma=-2.0 is invalid"):
        load_run_config(CONFIG, ["loss.dflash_gamma=-2.0"])
