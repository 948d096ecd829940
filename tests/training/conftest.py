"""Shared fixtures for the training tests: the embedded target and a small set of its own stories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specheads import load_target
from specheads.training.config import LossSection
from specheads.training.data import build_dataset, collate
from specheads.training.data_cli import regenerate
from specheads.training.dflash_loss import dflash_loss
from specheads.training.features import online_features
from specheads.training.losses import eagle3_loss, eagle_loss, medusa_loss

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "train"


def overrides(stories_file: Path, out: Path, **extra) -> list[str]:
    """`key=value` overrides for a short CLI run on `stories_file` writing to `out` (plus `extra`)."""
    values = {"output_dir": str(out), "data.source": str(stories_file), "data.max_length": 64, "trackers": "[]",
              "global_batch_size": 8, "micro_batch_size": 4, "optim.warmup_steps": 2, "log_steps": 5}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def dump_features(stories_file: Path, out: Path, *extra: str) -> int:
    """`specheads data dump-features` of `stories_file` for stories260K (64 tokens a story) into `out`, with `extra`
    flags; the command's exit code."""
    from specheads.cli import main

    return main(["data", "dump-features", "--target", "stories260K", "--data", str(stories_file), "--out", str(out),
                 "--max-length", "64", *extra])


def assert_offline_trains_like_online(config: str, head_type: str, stories_file: Path, tmp_path: Path,
                                       steps: dict) -> dict[str, torch.Tensor]:
    """A feature dump of the taps [1, 3, 4] (`--head-type head_type`) records them, and `specheads train config` with
    the `steps` overrides on it (`tmp_path/offline`) ends with the weights of the same run online (`tmp_path/online`),
    to 1e-4. Returns those weights."""
    from safetensors.torch import load_file

    from specheads.cli import main

    features = tmp_path / "features"
    assert dump_features(stories_file, features, "--head-type", head_type, "--feature-layers", "1,3,4") == 0
    assert json.loads((features / "index.json").read_text())["tapped_layers"] == [1, 3, 4]
    for mode, extra in (("online", {}), ("offline", {"feature_mode": "offline", "data.features_dir": str(features)})):
        assert main(["train", config, *overrides(stories_file, tmp_path / mode, **steps, **extra)]) == 0
    a = load_file(tmp_path / "online" / "final" / "model.safetensors")
    b = load_file(tmp_path / "offline" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=1e-4, msg=name)
    return a


def assert_two_processes_train_like_one(config: str, stories_file: Path, tmp_path: Path, port: int,
                                        common: dict) -> None:
    """`specheads train config` with the `common` overrides in one process (`tmp_path/one`), then under `accelerate
    launch` in two (`tmp_path/two`, DDP on the CPU, `port` for their rendezvous): the final weights agree to 1e-4."""
    from safetensors.torch import load_file

    from specheads.cli import main

    assert main(["train", config, *overrides(stories_file, tmp_path / "one", **common)]) == 0
    accelerate = str(Path(sys.executable).parent / "accelerate")
    command = [accelerate, "launch", "--config_file", str(REPO / "configs" / "accelerate" / "multi_cpu.yaml"),
               "--main_process_port", str(port), "-m", "specheads", "train", config,
               *overrides(stories_file, tmp_path / "two", **common)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())["world_size"] == 2
    one, two = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("one", "two"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-4, rtol=0, msg=name)


def depth1_accuracy(heads, target, tok, stories_file: Path) -> float:
    """Depth-1 top-1 agreement with the target over the first 16 stories (teacher-forced), any head type."""
    batch = collate([build_dataset(stories_file, tok, "text", 64)[i] for i in range(16)])
    features, logits = online_features(target, batch["input_ids"], batch["attention_mask"], heads.select_features)
    ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    with torch.no_grad():
        if heads.config.head_type == "medusa":
            out = medusa_loss(heads(features), logits, ids, loss_mask, LossSection())
        elif heads.config.head_type == "dflash":  # depth 1 of blocks anchored at every position
            out = dflash_loss(heads, features, logits, ids, attention, loss_mask, LossSection(dflash_blocks=0))
        elif heads.config.head_type == "eagle3":
            out = eagle3_loss(heads, features, logits, ids, attention, loss_mask, LossSection(ttt_steps=1))
        else:
            out = eagle_loss(heads, features, logits, ids, attention, loss_mask, LossSection(eval_depth=1))
    return out.metrics["acc_depth1"]


@pytest.fixture(scope="session")
def target_and_tokenizer():
    return load_target("stories260K")


@pytest.fixture(scope="session")
def stories_file(tmp_path_factory, target_and_tokenizer) -> Path:
    """64 short stories written by stories260K itself (fixed seed)."""
    target, tokenizer = target_and_tokenizer
    path = tmp_path_factory.mktemp("data") / "stories.jsonl"
    regenerate(target, tokenizer, path, stories=64, max_new_tokens=48, batch_size=64, seed=0, show_progress=False)
    return path


@pytest.fixture()
def chat_file(tmp_path) -> Path:
    """Two conversations in ShareGPT format and one in OpenAI format."""
    sharegpt = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me a story."},
                                      {"from": "gpt", "value": "Once upon a time there was a cat."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."},
                                      {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye bye."}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in sharegpt) + "\n")
    return path
