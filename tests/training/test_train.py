"""Real training runs on stories260K through the CLI: loss falls, accuracy beats untrained heads, exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specheads import create_heads, load_heads
from specheads.cli import main
from specheads.training.config import load_run_config
from specheads.training.train import (
    _HeadsView,
    check_world_size,
    latest_checkpoint,
    lr_lambda,
    make_accelerator,
)

from .conftest import CONFIGS, REPO, depth1_accuracy, overrides

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("head_type", ["eagle", "medusa"])
def test_short_run_learns(head_type, tmp_path, stories_file, target_and_tokenizer):
    target, tok = target_and_tokenizer
    out = tmp_path / head_type
    config = CONFIGS / f"{head_type}_stories260k.yaml"
    extra = {"max_steps": 40, "save_steps": 20, "trackers": "[tensorboard]", "optim.learning_rate": 0.01}
    assert main(["train", str(config), *overrides(stories_file, out, **extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 40 and metrics["world_size"] == 1
    final = out / "final"
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in final.iterdir()}
    assert "acc_depth1" in (final / "README.md").read_text()
    assert list(out.rglob("events.out.tfevents*"))  # TensorBoard logs
    trained = load_heads(final, target=target)
    assert len(trained.config.target_embedding_sample) == 16  # trained checkpoints can refuse another target
    torch.manual_seed(0)
    fresh = create_heads(target, head_type, **load_run_config(config).head.options)
    acc_trained, acc_fresh = depth1_accuracy(trained, target, tok, stories_file), depth1_accuracy(fresh, target, tok, stories_file)
    assert acc_trained > acc_fresh + 0.05, (acc_trained, acc_fresh)
    # the loss fell: compare the first logged loss with the last (read from the TensorBoard scalars)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(out.rglob("events.out.tfevents*")).parent))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert len(list((out / "checkpoints").glob("step-*"))) == 2  # save_total_limit


def _run_cli(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_then_resume_equals_uninterrupted(tmp_path, stories_file):
    config = str(CONFIGS / "eagle_stories260k.yaml")
    steps = {"max_steps": 24, "save_steps": 6, "save_total_limit": 5}
    # uninterrupted, in this process
    assert main(["train", config, *overrides(stories_file, tmp_path / "ref", **steps)]) == 0
    # killed with SIGKILL once a checkpoint exists, then the same command again
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "specheads", "train", config, *overrides(stories_file, out, **steps)]
    proc = _run_cli(command)
    deadline = time.time() + 240
    while latest_checkpoint(out) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    killed_at = latest_checkpoint(out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert killed_at is not None, proc.stdout.read()
    assert not (out / "final").exists() or json.loads((killed_at / "train_state.json").read_text())["step"] == 24
    resumed = _run_cli(command)
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log
    if json.loads((killed_at / "train_state.json").read_text())["step"] < 24:
        assert "resuming from" in log
    ref, got = load_file(tmp_path / "ref" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


# eagle3: the draft vocab comes back too; dflash: the same anchors are drawn again
@pytest.mark.parametrize("recipe", ["medusa_stories260k", "eagle3_stories260k", "dflash_stories260k"])
def test_stop_after_steps_then_resume_is_exact(tmp_path, stories_file, recipe):
    config = str(CONFIGS / f"{recipe}.yaml")
    steps = {"max_steps": 12, "save_steps": 4}
    assert main(["train", config, *overrides(stories_file, tmp_path / "ref", **steps)]) == 0
    out = tmp_path / "stopped"
    assert main(["train", config, *overrides(stories_file, out, stop_after_steps=8, **steps)]) == 0
    assert not (out / "final").exists() and latest_checkpoint(out).name == "step-00000008"
    assert main(["train", config, *overrides(stories_file, out, **steps)]) == 0
    ref, got = load_file(tmp_path / "ref" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def test_best_heads_survive_a_stop_and_resume_exactly(tmp_path, stories_file):
    """output_dir/best after a stop at step 8 and a rerun = after an uninterrupted run (record and weights)."""
    config = str(CONFIGS / "medusa_stories260k.yaml")
    steps = {"max_steps": 12, "save_steps": 4, "eval_steps": 4, "data.eval_fraction": 0.25, "optim.learning_rate": 0.02}
    assert main(["train", config, *overrides(stories_file, tmp_path / "ref", **steps)]) == 0
    out = tmp_path / "stopped"
    assert main(["train", config, *overrides(stories_file, out, stop_after_steps=8, **steps)]) == 0
    assert json.loads((out / "best" / "best.json").read_text())["step"] in (4, 8)
    assert main(["train", config, *overrides(stories_file, out, **steps)]) == 0
    record = (tmp_path / "ref" / "best" / "best.json").read_text()
    assert (out / "best" / "best.json").read_text() == record
    ref, got = load_file(tmp_path / "ref" / "best" / "model.safetensors"), load_file(out / "best" / "model.safetensors")
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    # save_best=false: no best folder
    assert main(["train", config, *overrides(stories_file, tmp_path / "off", save_best="false", **steps)]) == 0
    assert not (tmp_path / "off" / "best").exists()
    assert "best_step" not in json.loads((tmp_path / "off" / "metrics.json").read_text())


def test_early_stopping_ends_a_run_that_stopped_improving(tmp_path, stories_file, capsys):
    """learning_rate=0: every evaluation scores the same, so patience 2 stops at the third (step 6), with final and best
    heads; the same command again trains nothing, and patience 0 trains on to max_steps."""
    config = str(CONFIGS / "medusa_stories260k.yaml")
    out = tmp_path / "run"
    steps = {"max_steps": 12, "save_steps": 12, "eval_steps": 2, "data.eval_fraction": 0.25, "optim.learning_rate": 0}
    assert main(["train", config, *overrides(stories_file, out, early_stopping_patience=2, **steps)]) == 0
    assert "early stop at step 6" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["steps"], metrics["early_stopped"], metrics["best_step"]) == (6, True, 2)
    assert latest_checkpoint(out).name == "step-00000006" and (out / "final" / "model.safetensors").is_file()
    assert main(["train", config, *overrides(stories_file, out, early_stopping_patience=2, **steps)]) == 0
    assert "stopped early at step 6" in capsys.readouterr().out
    assert main(["train", config, *overrides(stories_file, out, early_stopping_patience=0, **steps)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 12 and "early_stopped" not in metrics


def test_time_limit_ends_the_run_with_final_heads_and_a_rerun_continues(tmp_path, stories_file, capsys):
    config = str(CONFIGS / "medusa_stories260k.yaml")
    out = tmp_path / "timed"
    # a limit of ~0 s: the run stops after its first step, saves a checkpoint and the final heads
    assert main(["train", config, *overrides(stories_file, out, max_steps=6, save_steps=6, time_limit_minutes=1e-6)]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 1
    assert (out / "final" / "model.safetensors").is_file() and latest_checkpoint(out).name == "step-00000001"
    # the same command without the limit resumes and ends where an uninterrupted run ends
    assert main(["train", config, *overrides(stories_file, out, max_steps=6, save_steps=6)]) == 0
    assert main(["train", config, *overrides(stories_file, tmp_path / "ref", max_steps=6, save_steps=6)]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6
    ref, got = load_file(tmp_path / "ref" / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    # the finished run, run again: it reports the recorded metrics and trains nothing
    written = (out / "final" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["train", config, *overrides(stories_file, out, max_steps=6, save_steps=6)]) == 0
    assert "is already trained to max_steps=6" in capsys.readouterr().out
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == written
    assert main(["train", config, *overrides(stories_file, tmp_path / "bad", time_limit_minutes=-1)]) == 2


def test_two_processes_match_one(tmp_path, stories_file):
    config = str(CONFIGS / "eagle_stories260k.yaml")
    common = {"max_steps": 6, "save_steps": 6, "global_batch_size": 8, "micro_batch_size": 2}
    assert main(["train", config, *overrides(stories_file, tmp_path / "one", **common)]) == 0
    accelerate = str(Path(sys.executable).parent / "accelerate")
    command = [accelerate, "launch", "--config_file", str(REPO / "configs" / "accelerate" / "multi_cpu.yaml"),
               "--main_process_port", "29547", "-m", "specheads", "train", config,
               *overrides(stories_file, tmp_path / "two", **common)]
    proc = _run_cli(command)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())["world_size"] == 2
    one, two = load_file(tmp_path / "one" / "final" / "model.safetensors"), load_file(tmp_path / "two" / "final" / "model.safetensors")
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-4, rtol=0, msg=name)


def test_bf16_autocast_on_the_cpu_trains_float32_heads(tmp_path, stories_file):
    """`accelerate launch --mixed_precision bf16` (ACCELERATE_MIXED_PRECISION) on the CPU runs the heads under
    bf16 autocast: the heads stay float32 and end close to, but not equal to, a float32 run's."""
    config = str(CONFIGS / "eagle3_stories260k.yaml")
    # Adam moves a weight by at most about the learning rate per step, so 4 steps at 1e-3 differ by < 1e-2
    steps = {"max_steps": 4, "save_steps": 4, "optim.learning_rate": 1e-3}
    finals, losses = {}, {}
    for precision in ("no", "bf16"):  # separate processes: Accelerate's state is per process
        out = tmp_path / precision
        command = [sys.executable, "-m", "specheads", "train", config, *overrides(stories_file, out, **steps)]
        proc = _run_cli(command, {"ACCELERATE_MIXED_PRECISION": precision})
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["mixed_precision"] == precision
        losses[precision] = metrics["loss"]
        finals[precision] = load_file(out / "final" / "model.safetensors")
    full, autocast = finals["no"], finals["bf16"]
    assert all(t.dtype == torch.float32 for t in autocast.values() if t.is_floating_point())
    assert any(not torch.equal(autocast[name], full[name]) for name in full if full[name].is_floating_point())
    for name in full:
        torch.testing.assert_close(autocast[name], full[name], atol=1e-2, rtol=0, msg=name)
    assert abs(losses["bf16"] - losses["no"]) < 0.05 * losses["no"], losses


def test_draft_logits_run_under_the_runs_autocast(target_and_tokenizer):
    """The draft lm_head runs outside the prepared model's forward: it gets the run's autocast context itself
    (bf16 products and out: the losses compute in float32), and none by default."""
    target, _ = target_and_tokenizer
    torch.manual_seed(0)
    heads = create_heads(target, "eagle3", draft_vocab_size=64)
    hidden = torch.randn(2, 5, target.config.hidden_size)
    plain = _HeadsView(heads, heads).logits(hidden)
    bf16 = _HeadsView(heads, heads, lambda: torch.autocast("cpu", dtype=torch.bfloat16)).logits(hidden)
    assert plain.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    torch.testing.assert_close(plain, heads.logits(hidden), rtol=0, atol=0)
    torch.testing.assert_close(bf16.float(), plain, rtol=0.05, atol=0.05)


def test_rank_zero_of_one_trap_is_detected(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2.*num_processes=1"):
        check_world_size(SimpleNamespace(num_processes=1))
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_world_size(SimpleNamespace(num_processes=1))


def test_offline_features_train_like_online(tmp_path, stories_file):
    features = tmp_path / "features"
    assert main(["data", "dump-features", "--target", "stories260K", "--data", str(stories_file), "--out", str(features),
                 "--max-length", "64"]) == 0
    config = str(CONFIGS / "medusa_stories260k.yaml")
    steps = {"max_steps": 4, "save_steps": 4}
    assert main(["train", config, *overrides(stories_file, tmp_path / "online", **steps)]) == 0
    assert main(["train", config, *overrides(stories_file, tmp_path / "offline", feature_mode="offline",
                                             **{"data.features_dir": str(features)}, **steps)]) == 0
    a, b = load_file(tmp_path / "online" / "final" / "model.safetensors"), load_file(tmp_path / "offline" / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=1e-4, msg=name)


def test_offline_and_online_runs_hold_out_the_same_examples(tmp_path, stories_file):
    """data.eval_fraction on offline features: the same split, weights and held-out scores as online."""
    features = tmp_path / "features"
    assert main(["data", "dump-features", "--target", "stories260K", "--data", str(stories_file), "--out", str(features),
                 "--max-length", "64"]) == 0
    config = str(CONFIGS / "medusa_stories260k.yaml")
    steps = {"max_steps": 4, "save_steps": 4, "data.eval_fraction": 0.25}
    assert main(["train", config, *overrides(stories_file, tmp_path / "online", **steps)]) == 0
    assert main(["train", config, *overrides(stories_file, tmp_path / "offline", feature_mode="offline",
                                             **{"data.features_dir": str(features)}, **steps)]) == 0
    online = json.loads((tmp_path / "online" / "metrics.json").read_text())
    offline = json.loads((tmp_path / "offline" / "metrics.json").read_text())
    assert online["eval_tokens"] == offline["eval_tokens"] > 0
    assert offline["eval_acc"] == pytest.approx(online["eval_acc"], abs=1e-3)
    a, b = load_file(tmp_path / "online" / "final" / "model.safetensors"), load_file(tmp_path / "offline" / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=1e-4, msg=name)


def test_deepspeed_auto_values_come_from_the_run_config():
    """Accelerate reads DeepSpeed's "auto" micro batch size from a DataLoader; we batch ourselves, so the run
    config fills it (and gradient clipping) before `prepare`. Without DeepSpeed nothing happens."""
    from specheads.training.train import fill_deepspeed_config

    config = load_run_config(CONFIGS / "eagle_stories260k.yaml")
    shipped = json.loads((REPO / "configs" / "deepspeed" / "zero2.json").read_text())
    plugin = SimpleNamespace(deepspeed_config=dict(shipped))
    fill_deepspeed_config(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)), config)
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == config.micro_batch_size
    assert plugin.deepspeed_config["gradient_clipping"] == config.optim.max_grad_norm
    assert plugin.deepspeed_config["zero_optimization"] == shipped["zero_optimization"]
    fill_deepspeed_config(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)), config)  # no DeepSpeed


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3", "dflash"])
def test_heads_in_bf16_train_against_a_float32_target(head_type, stories_file, target_and_tokenizer):
    """DeepSpeed with bf16 turns the prepared heads' weights into bf16 without autocast, while the frozen target
    stays float32: the loss still runs (inputs cast to the heads' dtype, outputs back to float32), gradients
    reach the bf16 weights, and the loss is close to the float32 heads' loss."""
    from specheads.training.data import build_dataset, collate
    from specheads.training.train import compute_loss

    target, tokenizer = target_and_tokenizer
    config = load_run_config(CONFIGS / f"{head_type}_stories260k.yaml")
    torch.manual_seed(0)
    heads = create_heads(target, head_type, **config.head.options)
    batch = collate([build_dataset(stories_file, tokenizer, "text", 64)[i] for i in range(4)])
    seeds = list(range(4))
    reference = compute_loss(config, heads, heads, target, batch, seeds).loss
    heads.to(torch.bfloat16)
    loss = compute_loss(config, heads, heads, target, batch, seeds).loss
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in heads.parameters() if p.requires_grad)
    assert abs(loss.item() - reference.item()) < 0.05 * abs(reference.item())


def test_init_heads_continues_from_trained_heads(tmp_path, stories_file, target_and_tokenizer):
    """init_heads=FOLDER: training starts from those weights and keeps their draft vocabulary; the heads' type
    and options must agree with the run config (errors name both values)."""
    from dataclasses import replace

    from specheads.training.train import initial_heads

    target, _ = target_and_tokenizer
    config = str(CONFIGS / "eagle3_stories260k.yaml")
    steps = {"max_steps": 4, "save_steps": 4}
    assert main(["train", config, *overrides(stories_file, tmp_path / "first", **steps)]) == 0
    first = tmp_path / "first" / "final"
    trained = load_file(first / "model.safetensors")
    run = load_run_config(config, overrides(stories_file, tmp_path / "second", init_heads=str(first), **steps))
    start = initial_heads(run, target).state_dict()
    assert trained.keys() <= start.keys()
    for name, tensor in trained.items():
        assert torch.equal(start[name], tensor), name
    assert main(["train", config, *overrides(stories_file, tmp_path / "second", init_heads=str(first),
                                             **{"optim.learning_rate": 0.05}, **steps)]) == 0
    second = load_file(tmp_path / "second" / "final" / "model.safetensors")
    assert torch.equal(second["d2t"], trained["d2t"])  # the vocabulary came with the heads, not from the data
    assert any(not torch.equal(second[k], trained[k]) for k in trained if k not in ("d2t", "t2d"))  # trained on
    assert json.loads((tmp_path / "second" / "metrics.json").read_text())["init_heads"] == str(first)
    with pytest.raises(ValueError, match="holds eagle3 heads but head.type='eagle'"):
        initial_heads(replace(run, head=replace(run.head, type="eagle")), target)
    with pytest.raises(ValueError, match=r"head.options.draft_vocab_size=128 .* has draft_vocab_size=256"):
        initial_heads(replace(run, head=replace(run.head, options={"draft_vocab_size": 128})), target)


def test_learning_rate_schedules_warm_up_then_decay_or_hold():
    """Linear warmup over optim.warmup_steps, then cosine down to optim.min_lr_ratio at max_steps, or constant."""
    cosine = lr_lambda(load_run_config(None, ["data.source=x.jsonl", "max_steps=12", "optim.warmup_steps=2",
                                              "optim.min_lr_ratio=0.1"]))
    assert [cosine(s) for s in (0, 1)] == [0.5, 1.0]
    assert cosine(2) == pytest.approx(1.0) and cosine(7) == pytest.approx(0.55) and cosine(12) == pytest.approx(0.1)
    assert all(cosine(s) >= cosine(s + 1) for s in range(2, 20)) and cosine(40) == pytest.approx(0.1)
    constant = lr_lambda(load_run_config(None, ["data.source=x.jsonl", "optim.warmup_steps=4", "optim.schedule=constant"]))
    assert [constant(s) for s in (0, 3, 4, 500)] == [0.25, 1.0, 1.0, 1.0]


def test_a_wandb_tracker_without_wandb_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, installed or not
    config = load_run_config(None, ["data.source=x.jsonl", f"output_dir={tmp_path}", "trackers=[tensorboard, wandb]"])
    with pytest.raises(ValueError, match=r"trackers contains 'wandb' but wandb is not installed \(pip install specheads\[wandb\]\)"):
        make_accelerator(config)


def test_train_without_a_config_file_starts_from_the_defaults(tmp_path, stories_file):
    """`specheads train key=value ...`: no YAML, RunConfig's defaults plus the overrides."""
    out = tmp_path / "run"
    assert main(["train", *overrides(stories_file, out, **{"head.type": "medusa", "max_steps": 2, "save_steps": 2})]) == 0
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["head"]["type"] == "medusa" and saved["target"] == "stories260K" and saved["max_steps"] == 2
    assert json.loads((out / "final" / "config.json").read_text())["head_type"] == "medusa"


def test_training_pushes_its_best_heads(tmp_path, stories_file, fake_hub_api, capsys):
    """push_to_hub=ID: the best heads (eval_steps set) are pushed at the end; a failed push names the saved folder
    and the command that retries it."""
    hub = fake_hub_api()
    extra = {"max_steps": 4, "save_steps": 4, "eval_steps": 2, "data.eval_fraction": 0.25, "push_to_hub": "test-org/run"}
    out = tmp_path / "run"
    assert main(["train", str(CONFIGS / "medusa_stories260k.yaml"), *overrides(stories_file, out, **extra)]) == 0
    record = json.loads((out / "best" / "best.json").read_text())
    assert hub.repos == [("test-org/run", False)] and "best.json" in hub.files
    assert json.loads(hub.files["best.json"]) == record
    fake_hub_api(fail=True)
    capsys.readouterr()
    assert main(["train", str(CONFIGS / "medusa_stories260k.yaml"),
                 *overrides(stories_file, tmp_path / "again", **{**extra, "eval_steps": 0})]) == 2
    err = capsys.readouterr().err
    assert "push them again with `specheads push" in err and str(tmp_path / "again" / "final") in err
