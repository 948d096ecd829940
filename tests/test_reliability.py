"""Reliability: clear errors for bad input, early failure on unwritable or full disks, kill -9 safe data commands.

The bad-input cases of issue 9 and where each one is tested (not repeated here):

| case | exception | covered in |
|---|---|---|
| heads for a target of another hidden size / vocabulary | ValueError | tests/heads/test_checkpoint.py::test_heads_for_another_target_are_refused |
| EAGLE heads for a target of another family | ValueError | tests/heads/test_checkpoint.py::test_eagle_heads_for_another_family_are_refused |
| heads for a same-shaped target with other weights / tokenizer | ValueError | here (target_embedding_sample) |
| empty prompt, out-of-vocabulary ids, prompt + max_new_tokens beyond the context, negative max_new_tokens, do_sample with temperature <= 0 | ValueError | tests/inference/test_generate_batch.py::test_bad_generate_arguments_raise_clear_errors |
| max_new_tokens=0 returns the prompt | - | tests/inference/test_generate_greedy.py::test_zero_and_one_new_tokens |
| unknown head type | ValueError | tests/heads/test_checkpoint.py::test_create_heads_unknown_type_lists_known_types, tests/heads/test_heads_config.py::test_unknown_head_type_names_the_field_and_known_types |
| corrupted / truncated safetensors | ValueError | tests/heads/test_checkpoint.py::test_corrupt_weights_name_the_file |
| missing checkpoint folder | FileNotFoundError | tests/heads/test_checkpoint.py::test_missing_folder_names_it |
| config.json with invalid values | ValueError | tests/heads/test_checkpoint.py::test_invalid_config_values_name_the_field (+ target_embedding_sample here) |
| run configs with unknown keys / wrong types | ValueError | tests/training/test_config.py::test_unknown_key_names_key_and_valid_ones, ::test_wrong_type_names_key_value_and_type |
| a dataset with no assistant turns | ValueError | tests/training/test_data.py::test_no_assistant_turns_is_an_error |

Crash safety of `train` (kill -9, exact resume) is in tests/training/test_train.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specheads import HeadsConfig, SpeculativeLM, create_heads, load_heads, load_target
from specheads.training.config import load_run_config
from specheads.training.data import build_dataset
from specheads.training.data_cli import data_main, regenerate
from specheads.training.features import (
    INDEX_NAME,
    PROGRESS_NAME,
    OfflineFeatures,
    dump_features,
    online_features,
)
from specheads.training.train import train

REPO = Path(__file__).resolve().parents[1]
DiskUsage = namedtuple("DiskUsage", "total used free")


def tiny_llama(seed: int) -> torch.nn.Module:
    """A seeded 2-layer Llama (hidden 64, vocab 97); two seeds give same-shaped targets with other weights."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.config.name_or_path = f"tiny-org/tiny-llama-seed{seed}"
    return model.eval().requires_grad_(False)


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture(scope="module")
def stories():
    return load_target("stories260K")


@pytest.fixture()
def small_disk(monkeypatch):
    """`shutil.disk_usage` reports 1 KiB free everywhere."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12 - 1024, 1024))


# --- heads built for another target of the same shape ------------------------------------------------------
@pytest.mark.parametrize("head_type", ["eagle", "medusa"])
def test_heads_for_a_same_shaped_other_target_are_refused(tmp_path, head_type):
    """Equal hidden size and vocabulary but other embedding weights: ValueError naming the field and the
    target the heads were built for, from attach_target, load_heads(target=...) and SpeculativeLM."""
    built_for, other = tiny_llama(0), tiny_llama(1)
    heads = create_heads(built_for, head_type)
    assert len(heads.config.target_embedding_sample) == 16
    heads.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["target_embedding_sample"] == heads.config.target_embedding_sample
    match = r"target_embedding_sample.*built for 'tiny-org/tiny-llama-seed0'"
    with pytest.raises(ValueError, match=match):
        heads.attach_target(other)
    with pytest.raises(ValueError, match=match):
        load_heads(tmp_path, target=other)
    with pytest.raises(ValueError, match=match):
        SpeculativeLM(other, load_heads(tmp_path))
    load_heads(tmp_path, target=built_for)  # the right target is accepted


def test_embedding_sample_survives_half_precision_targets(tmp_path):
    """Heads built on a float32 target attach to its bf16 / fp16 copies, and the other way round."""
    heads = create_heads(tiny_llama(0), "medusa")
    heads.save_pretrained(tmp_path)
    for dtype in (torch.bfloat16, torch.float16):
        low = tiny_llama(0).to(dtype)
        load_heads(tmp_path, target=low)
        create_heads(low, "medusa").attach_target(tiny_llama(0))


def test_unknown_embedding_sample_skips_the_check(tmp_path):
    """Checkpoints without the sample (imported or written before it existed) still load on any same-shaped target."""
    heads = create_heads(tiny_llama(0), "medusa")
    heads.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["target_embedding_sample"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_heads(tmp_path, target=tiny_llama(1))
    assert loaded.config.target_embedding_sample == []


@pytest.mark.parametrize("value", ["abc", [1.0, "x"], 3, [True]])
def test_invalid_embedding_sample_names_the_field(value):
    with pytest.raises(ValueError, match=r"target_embedding_sample=.*list of floats"):
        HeadsConfig(head_type="medusa", target_embedding_sample=value)


# --- unwritable output and full disks fail early -----------------------------------------------------------
def test_train_refuses_an_unwritable_output_dir(tmp_path, stories):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = load_run_config(None, [f"output_dir={blocker}/run", "data.source=unused.jsonl"])
    with pytest.raises(OSError, match=r"output_dir '.*a-file/run' is not writable"):
        train(config)


def test_train_refuses_a_too_small_disk(tmp_path, stories, small_disk):
    out = tmp_path / "run"
    config = load_run_config(None, [f"output_dir={out}", "data.source=unused.jsonl", "head.type=medusa",
                                    "save_total_limit=2", "trackers=[]"])
    with pytest.raises(OSError, match=rf"not enough disk for training \d+ parameters .*'{out}'.*needs about \d+ bytes.*only 1024 bytes"):
        train(config)
    assert not (out / "checkpoints").exists()


def test_dump_features_refuses_a_too_small_disk(tmp_path, stories, small_disk):
    target, tokenizer = stories
    dataset = build_dataset(_jsonl(tmp_path / "one.jsonl", ["Once upon a time there was a cat."]), tokenizer, "text")
    with pytest.raises(OSError, match=r"not enough disk for the feature dump.*needs about \d+ bytes.*only 1024 bytes"):
        dump_features(target, dataset, tmp_path / "features", 5, show_progress=False)
    assert not list((tmp_path / "features").iterdir())


def test_data_commands_refuse_unwritable_outputs(tmp_path, stories):
    target, tokenizer = stories
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match=r"regenerate --output.*a-file.*not writable"):
        data_main(["regenerate", "--stories", "2", "--output", str(blocker / "out.jsonl")])
    with pytest.raises(OSError, match=r"regenerate output.*is a folder"):
        regenerate(target, tokenizer, tmp_path, stories=2, show_progress=False)
    with pytest.raises(OSError, match=r"dump-features --out '.*a-file/features' is not writable"):
        data_main(["dump-features", "--data", "unused.jsonl", "--out", str(blocker / "features")])


# --- kill -9 during the data commands, then the same command again ----------------------------------------
def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "specheads", "data", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 60.0) -> None:
    """SIGKILL `proc` as soon as `ready()` is true; fail if it finished (or timed out) first."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"finished before it could be killed:\n{proc.stdout.read()}"
        assert time.time() < deadline, "no progress before the timeout"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _run(args: list[str]) -> str:
    proc = _start(args)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def test_regenerate_survives_kill_9(tmp_path, stories):
    count = 48
    output = tmp_path / "stories.jsonl"
    args = ["regenerate", "--target", "stories260K", "--stories", str(count), "--output", str(output),
            "--max-new-tokens", "16", "--batch-size", "4", "--seed", "3"]
    _kill_when(_start(args), lambda: output.is_file() and b"\n" in output.read_bytes())
    killed_at = len(output.read_bytes().splitlines())
    assert 0 < killed_at < count
    _run(args)
    lines = output.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is complete JSON
    assert sorted(r["id"] for r in records) == [f"story-{i:06d}" for i in range(count)]
    assert all(isinstance(r["text"], str) and r["text"] for r in records)
    target, tokenizer = stories  # all done: the same job (in-process) writes nothing more
    assert regenerate(target, tokenizer, output, stories=count, max_new_tokens=16, batch_size=4, seed=3,
                      show_progress=False) == 0


def test_dump_features_survives_kill_9(tmp_path, stories):
    target, tokenizer = stories
    data = tmp_path / "data.jsonl"
    texts = ["Once upon a time there was a little cat.", "Tom and Sue went to the park to play.", "The sun was hot."]
    data.write_text("".join(json.dumps({"id": i, "text": f"{texts[i % 3]} Story {i}."}) + "\n" for i in range(480)))
    out = tmp_path / "features"
    args = ["dump-features", "--target", "stories260K", "--data", str(data), "--out", str(out),
            "--examples-per-shard", "8", "--batch-size", "1", "--max-length", "64"]
    _kill_when(_start(args), lambda: (out / PROGRESS_NAME).is_file())
    assert not (out / INDEX_NAME).exists()  # a killed dump never looks complete
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert kept
    log = _run(args)
    assert "resuming:" in log
    index = json.loads((out / INDEX_NAME).read_text())
    assert len(index["shards"]) == 60 and index["num_examples"] == 480
    assert not (out / PROGRESS_NAME).exists() and not list(out.glob("*.partial"))
    rewritten = [name for name, mtime in kept.items() if (out / name).stat().st_mtime_ns != mtime]
    assert len(rewritten) <= 1, rewritten  # at most the shard being written when killed
    features = OfflineFeatures(out)  # checks every shard's sha256 on first use
    dataset = build_dataset(data, tokenizer, "auto", 64)
    assert features.lengths() == dataset["length"]
    for i in (0, 7, 8, 479):
        ids = torch.tensor([dataset[i]["input_ids"]])
        expected, _ = online_features(target, ids, torch.ones_like(ids), lambda hs: hs[-1])
        torch.testing.assert_close(features[i]["features"], expected[0], atol=1e-5, rtol=1e-5)


def test_dump_features_resume_rewrites_only_bad_shards(tmp_path, stories, capsys):
    """In-process: a corrupted shard is rewritten, good ones are kept; other data reuses nothing."""
    target, tokenizer = stories
    dataset = build_dataset(_jsonl(tmp_path / "a.jsonl", [f"Lily had a red ball number {i}." for i in range(12)]),
                            tokenizer, "text")
    out = tmp_path / "features"
    first = dump_features(target, dataset, out, 5, examples_per_shard=4, show_progress=False)
    shard = out / first["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    os.replace(out / INDEX_NAME, out / PROGRESS_NAME)  # as if killed just before the index was written
    capsys.readouterr()
    again = dump_features(target, dataset, out, 5, examples_per_shard=4, show_progress=False)
    assert "resuming: 2 of 3 shards" in capsys.readouterr().out
    assert again == first
    other = build_dataset(_jsonl(tmp_path / "b.jsonl", [f"Tom saw a dog number {i}." for i in range(12)]), tokenizer, "text")
    changed = dump_features(target, other, out, 5, examples_per_shard=4, show_progress=False)
    assert "resuming" not in capsys.readouterr().out
    assert changed["data_sha256"] != first["data_sha256"]
